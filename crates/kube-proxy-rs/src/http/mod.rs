//! The proxy's HTTP side: the metrics/healthz server and its state
//! (`server`), the per-Service health check ports (`health`), the component
//! pages /flagz, /statusz, /configz (`zpages`) and /debug (`debug`).

pub mod debug;
pub mod health;
pub mod server;
pub mod zpages;
