//! The binary's side of the API: the client it builds from the kubeconfig or
//! the in-cluster account (`client`), the source it starts (`source`), the
//! Events it records (`events`) and the watch on its own Node for PodCIDRs
//! and host addresses, upstream's NodeManager (`node`).

pub mod client;
pub mod events;
pub mod node;
pub mod source;
