//! The tc programs for traffic from outside the node (`--bpf-nodeport`,
//! bpf/tc.c) and the XDP one (`--bpf-lb-acceleration`, bpf/xdp.c): loading them beside the socket programs' maps, and
//! keeping them attached to the node's interfaces.
//!
//! `kp_np_external` goes on the node's external interfaces (named by
//! `--bpf-nodeport-devices`, else those a default route leaves by, as
//! Cilium picks its devices), `kp_np_from_pod` on every other one but
//! loopback (pods' veths, a CNI
//! bridge), where the replies of this node's endpoints arrive. Pods come and
//! go, so [`NodePort::attach`] runs before every sync's map writes: a pod's
//! interface exists before the pod is ready, so it has its program before
//! any Service can send to it. Each attachment is a TCX link (Linux 6.6)
//! pinned under `links/tc/`, so the programs stay through a restart and a
//! starting proxy adopts them; a link whose interface is gone is unpinned.
//!
//! With `--bpf-lb-acceleration` the external interfaces also get
//! `kp_np_xdp` in the driver (native XDP), pinned beside the tc links: it
//! takes the flows the node sends back out of the interface they came in
//! by (endpoints on other nodes) before the kernel makes an skb, and passes
//! everything else to tc.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use aya::maps::{Array, MapData};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::TcAttachType;
use aya::programs::{SchedClassifier, Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader};

use crate::kernel::{
    boxed, bpf, io, is_missing, links_dir, program_as, remove_empty_dir, remove_file,
    replace_if_different, Capacity,
};
use crate::maps::{
    addr_words, BACKENDS, MEMBERS, NODEPORT_MAPS, NP_FLOWS, NP_FLOW_VALUE_SIZE, NP_NODE,
    RETIRED_NODEPORT_MAPS, SERVICES,
};
use crate::SocketLbError;

/// bpf/tc.c compiled by build.rs (empty without clang).
#[doc(hidden)]
pub static TC_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tc.o"));
/// bpf/xdp.c compiled by build.rs (empty without clang): loaded over the
/// maps tc.o pinned (they are pinned by name).
#[doc(hidden)]
pub static XDP_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdp.o"));

/// What a program does on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Holds a node address: requests from outside, and the replies of
    /// endpoints on other nodes.
    External,
    /// Anything else: the replies of this node's endpoints.
    FromPod,
}

impl Role {
    fn program(self) -> &'static str {
        match self {
            Role::External => "kp_np_external",
            Role::FromPod => "kp_np_from_pod",
        }
    }
    fn tag(self) -> &'static str {
        match self {
            Role::External => "ext",
            Role::FromPod => "pod",
        }
    }
}

/// bpf/test/xdp_pass.c: an XDP program that passes every frame, for the far
/// end of a lab's veth that a node's XDP sends frames back into (veth
/// wakes that end for them only while it runs an XDP program). For the
/// tests and kp-bench pps, not the proxy.
#[doc(hidden)]
pub static XDP_PASS_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/xdp_pass.o"));

/// The programs, by the names they have in the object.
pub const NODEPORT_PROGRAMS: [&str; 2] = ["kp_np_external", "kp_np_from_pod"];
/// The XDP program of `--bpf-lb-acceleration`.
pub const XDP_PROGRAM: &str = "kp_np_xdp";

/// `--bpf-lb-acceleration` (Cilium's flag and values): whether the external
/// interfaces also get the XDP program.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Acceleration {
    /// tc only.
    #[default]
    Disabled,
    /// XDP in the driver on every external interface; a driver without
    /// native XDP is an error.
    Native,
    /// XDP in the driver where it has it, tc alone elsewhere.
    BestEffort,
}

impl Acceleration {
    pub fn parse(s: &str) -> Option<Acceleration> {
        match s {
            "disabled" => Some(Acceleration::Disabled),
            "native" => Some(Acceleration::Native),
            "best-effort" => Some(Acceleration::BestEffort),
            _ => None,
        }
    }
}

/// An interface of the node and its role.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub role: Role,
}

impl Interface {
    /// Its link's pin name: the index too, since a pod's interface name
    /// comes back with the next pod.
    fn pin_name(&self) -> String {
        format!("{}-{}@{}", self.role.tag(), self.name, self.index)
    }
    /// Its XDP link's pin name.
    fn xdp_pin_name(&self) -> String {
        format!("xdp-{}@{}", self.name, self.index)
    }
}

/// The interfaces a default route leaves by (IPv4 or IPv6), in this
/// network namespace.
pub fn default_route_devices() -> Vec<String> {
    let mut out = BTreeSet::new();
    // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
    if let Ok(t) = std::fs::read_to_string("/proc/net/route") {
        for l in t.lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() > 7 && f[1] == "00000000" && f[7] == "00000000" {
                out.insert(f[0].to_string());
            }
        }
    }
    // dest prefixlen src srcprefixlen nexthop metric refcnt use flags iface
    if let Ok(t) = std::fs::read_to_string("/proc/net/ipv6_route") {
        for l in t.lines() {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() == 10 && f[0].bytes().all(|b| b == b'0') && f[1] == "00" && f[9] != "lo" {
                out.insert(f[9].to_string());
            }
        }
    }
    out.into_iter().collect()
}

/// This network namespace's interfaces but loopback, with their roles:
/// external when named in `external`.
pub fn interfaces(external: &[String]) -> Result<Vec<Interface>, SocketLbError> {
    let mut names: BTreeSet<String> = BTreeSet::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io("listing the node's interfaces".into())(
            std::io::Error::last_os_error(),
        ));
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string of the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        names.insert(name);
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    let mut out = Vec::new();
    for name in names {
        let is_external = external.contains(&name);
        if name == "lo" {
            continue;
        }
        let Ok(c) = std::ffi::CString::new(name.clone()) else {
            continue;
        };
        // SAFETY: a valid C string.
        let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
        if index == 0 {
            continue; // gone meanwhile
        }
        out.push(Interface {
            name,
            index,
            role: if is_external {
                Role::External
            } else {
                Role::FromPod
            },
        });
    }
    Ok(out)
}

/// The loaded programs, ready to be attached to new interfaces.
pub struct NodePort {
    obj: Ebpf,
    /// xdp.o, once `--bpf-lb-acceleration` asks for it.
    xdp_obj: Option<Ebpf>,
    cap: Capacity,
    pin_dir: PathBuf,
    xdp: Acceleration,
    /// Interfaces (XDP pin names) whose driver refused native XDP under
    /// best-effort: not asked again at every sync.
    refused: BTreeSet<String>,
    /// `--bpf-nodeport-devices`: the external interfaces (empty: those the
    /// default routes leave by).
    devices: Vec<String>,
}

/// What [`NodePort::attach`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Attached {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Adopted links that ran another version of the program, now ours.
    pub upgraded: Vec<String>,
}

fn tc_dir(pin_dir: &Path) -> PathBuf {
    links_dir(pin_dir).join("tc")
}

impl NodePort {
    /// Loads the programs over the maps pinned in `pin_dir` (the socket
    /// programs' install made them: call this after it) and records the
    /// node's addresses, the source of translated requests.
    pub fn install(
        pin_dir: &Path,
        cap: Capacity,
        node_v4: Option<Ipv4Addr>,
        node_v6: Option<Ipv6Addr>,
    ) -> Result<NodePort, SocketLbError> {
        if TC_OBJECT.is_empty() {
            return Err(SocketLbError::Unsupported(
                "this binary was built without clang, so it has no BPF programs (apt-get install clang, then rebuild)".into(),
            ));
        }
        let dir = tc_dir(pin_dir);
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        // An earlier version's flow tables: their layout is not this one's
        // (the programs would not load over them). Their flows go; a TCP
        // connection through them is dropped, as a conntrack flush would.
        for m in RETIRED_NODEPORT_MAPS {
            remove_file(&pin_dir.join(m))?;
        }
        let flows = pin_dir.join(NP_FLOWS);
        if let Ok(info) = aya::maps::MapInfo::from_pin(&flows) {
            if info.value_size() != NP_FLOW_VALUE_SIZE {
                tracing::info!(map = %flows.display(), "flow table of an earlier version replaced");
                remove_file(&flows)?;
            }
        }
        let mut obj = load(pin_dir, cap, TC_OBJECT, "tc")?;
        // maps.rs and bpf/lib/maps.h must agree on the entry's size (the
        // check above relies on it).
        match aya::maps::MapInfo::from_pin(&flows) {
            Ok(info) if info.value_size() == NP_FLOW_VALUE_SIZE => {}
            Ok(info) => {
                return Err(SocketLbError::Bpf {
                    what: format!("map {NP_FLOWS}"),
                    message: format!(
                        "entries of {} bytes, maps.rs says {NP_FLOW_VALUE_SIZE}",
                        info.value_size()
                    ),
                })
            }
            Err(e) => return Err(bpf(format!("map {}", flows.display()))(boxed(e))),
        }
        for name in NODEPORT_PROGRAMS {
            program(&mut obj, name)?
                .load()
                .map_err(|e| bpf(format!("verifying program {name}"))(boxed(e)))?;
        }
        let node = obj.map_mut(NP_NODE).ok_or_else(|| SocketLbError::Bpf {
            what: format!("map {NP_NODE}"),
            message: "missing from the BPF object".into(),
        })?;
        let mut node: Array<&mut MapData, [u32; 4]> =
            Array::try_from(node).map_err(|e| bpf(format!("map {NP_NODE}"))(boxed(e)))?;
        let v4 = node_v4.map_or([0; 4], |ip| addr_words(IpAddr::V4(ip)));
        let v6 = node_v6.map_or([0; 4], |ip| addr_words(IpAddr::V6(ip)));
        for (i, a) in [(0u32, v4), (1, v6)] {
            node.set(i, a, 0)
                .map_err(|e| bpf(format!("writing the node's address into {NP_NODE}"))(boxed(e)))?;
        }
        Ok(NodePort {
            obj,
            xdp_obj: None,
            cap,
            pin_dir: pin_dir.to_path_buf(),
            xdp: Acceleration::Disabled,
            refused: BTreeSet::new(),
            devices: Vec::new(),
        })
    }

    /// `--bpf-lb-acceleration`: loads the XDP program (the verifier has its
    /// say at start) for the next [`NodePort::attach`] to put on the
    /// external interfaces; Disabled takes their XDP links away there.
    pub fn set_acceleration(&mut self, xdp: Acceleration) -> Result<(), SocketLbError> {
        if xdp != Acceleration::Disabled {
            if self.xdp_obj.is_none() {
                self.xdp_obj = Some(load(&self.pin_dir, self.cap, XDP_OBJECT, "XDP")?);
            }
            self.xdp_program()?
                .load()
                .map_err(|e| bpf(format!("verifying program {XDP_PROGRAM}"))(boxed(e)))?;
        }
        self.xdp = xdp;
        Ok(())
    }
}

/// Records the node's IPv6 address in the pinned `kp_np_node` (the IPv4
/// dataplane's [`NodePort::install`] made it): the source of translated
/// IPv6 requests where the kernel names none.
pub fn set_node_v6(pin_dir: &Path, ip: Ipv6Addr) -> Result<(), SocketLbError> {
    let path = pin_dir.join(NP_NODE);
    let data = MapData::from_pin(&path)
        .map_err(|e| bpf(format!("opening map {}", path.display()))(boxed(e)))?;
    let mut node: Array<MapData, [u32; 4]> = Array::try_from(aya::maps::Map::Array(data))
        .map_err(|e| bpf(format!("map {}", path.display()))(boxed(e)))?;
    node.set(1, addr_words(IpAddr::V6(ip)), 0)
        .map_err(|e| bpf(format!("writing the node's IPv6 address into {NP_NODE}"))(boxed(e)))
}

impl NodePort {
    /// The external interfaces (`--bpf-nodeport-devices`; empty: those the
    /// default routes leave by, looked up at every attach).
    pub fn set_devices(&mut self, devices: Vec<String>) {
        self.devices = devices;
    }
}

/// What the dataplane ([`crate::SocketLbProxier::with_nodeport`]) calls at
/// every sync: the programs on the interfaces as they are now.
impl crate::proxier::Attach for NodePort {
    fn attach(&mut self) -> Result<(), kp_model::DataplaneError> {
        let fail = |e: SocketLbError| kp_model::DataplaneError::Apply {
            tool: "tc programs".into(),
            message: e.to_string(),
        };
        let external = if self.devices.is_empty() {
            default_route_devices()
        } else {
            self.devices.clone()
        };
        let ifaces = interfaces(&external).map_err(fail)?;
        let done = NodePort::attach(self, &ifaces).map_err(fail)?;
        if done != Attached::default() {
            // Links came or went: the flows' cached routes are asked again.
            crate::kernel::bump_generation(&self.pin_dir, 0).map_err(fail)?;
            tracing::info!(added = ?done.added, removed = ?done.removed, upgraded = ?done.upgraded,
                "tc programs attached");
        }
        Ok(())
    }
}

impl NodePort {
    /// Puts the right program on every interface of `ifaces` (adopting
    /// links already pinned for it) and unpins the links of interfaces no
    /// longer there or whose role changed.
    pub fn attach(&mut self, ifaces: &[Interface]) -> Result<Attached, SocketLbError> {
        let dir = tc_dir(&self.pin_dir);
        let mut wanted: BTreeSet<String> = ifaces.iter().map(Interface::pin_name).collect();
        let xdp_on: Vec<&Interface> = match self.xdp {
            Acceleration::Disabled => Vec::new(),
            _ => ifaces.iter().filter(|i| i.role == Role::External).collect(),
        };
        wanted.extend(xdp_on.iter().map(|i| i.xdp_pin_name()));
        let mut out = Attached::default();
        for name in pinned(&dir)? {
            if !wanted.contains(&name) {
                remove_file(&dir.join(&name))?;
                out.removed.push(name);
            }
        }
        for iface in ifaces {
            let pin = dir.join(iface.pin_name());
            let name = iface.role.program();
            if PinnedLink::from_pin(&pin).is_ok() {
                let on = format!("on {}", iface.name);
                if replace_if_different(&self.obj, name, &pin, &on)? {
                    out.upgraded.push(iface.pin_name());
                }
                continue;
            }
            let prog = program(&mut self.obj, name)?;
            // A pin that is no link (a half-written one) goes first.
            remove_file(&pin)?;
            let id = match prog.attach(&iface.name, TcAttachType::Ingress) {
                Ok(id) => id,
                // The interface went away meanwhile (a pod deleted): the
                // next sync's list no longer has it.
                Err(e) if gone(&iface.name) => {
                    tracing::debug!(interface = %iface.name, error = %e, "interface gone before its program was attached");
                    continue;
                }
                Err(e) => return Err(bpf(format!("attaching {name} to {}", iface.name))(boxed(e))),
            };
            let link: FdLink = prog
                .take_link(id)
                .map_err(|e| bpf(format!("link of {name} on {}", iface.name))(boxed(e)))?
                .try_into()
                .map_err(|e| bpf(format!("link of {name} on {}", iface.name))(boxed(e)))?;
            link.pin(&pin)
                .map_err(|e| bpf(format!("pinning {name}'s link on {}", iface.name))(boxed(e)))?;
            out.added.push(iface.pin_name());
        }
        for iface in xdp_on {
            self.attach_xdp(&dir, iface, &mut out)?;
        }
        Ok(out)
    }

    fn attach_xdp(
        &mut self,
        dir: &Path,
        iface: &Interface,
        out: &mut Attached,
    ) -> Result<(), SocketLbError> {
        let pin_name = iface.xdp_pin_name();
        let pin = dir.join(&pin_name);
        if PinnedLink::from_pin(&pin).is_ok() {
            let on = format!("on {}", iface.name);
            let obj = self.xdp_obj.as_ref().ok_or_else(no_xdp)?;
            if replace_if_different(obj, XDP_PROGRAM, &pin, &on)? {
                out.upgraded.push(pin_name);
            }
            return Ok(());
        }
        if self.refused.contains(&pin_name) {
            return Ok(());
        }
        let prog = self.xdp_program()?;
        remove_file(&pin)?;
        let id = match prog.attach_to_if_index(iface.index, XdpMode::Driver) {
            Ok(id) => id,
            Err(e) if gone(&iface.name) => {
                tracing::debug!(interface = %iface.name, error = %e, "interface gone before its XDP program was attached");
                return Ok(());
            }
            Err(e) if self.xdp == Acceleration::BestEffort => {
                tracing::warn!(interface = %iface.name, error = %e,
                    "no native XDP on this interface (--bpf-lb-acceleration best-effort): tc alone serves it");
                self.refused.insert(pin_name);
                return Ok(());
            }
            Err(e) => {
                return Err(bpf(format!(
                    "attaching {XDP_PROGRAM} to {} in the driver (--bpf-lb-acceleration native; best-effort leaves an interface without native XDP to tc)",
                    iface.name
                ))(boxed(e)))
            }
        };
        let link: FdLink = prog
            .take_link(id)
            .map_err(|e| bpf(format!("link of {XDP_PROGRAM} on {}", iface.name))(boxed(e)))?
            .try_into()
            .map_err(|e| bpf(format!("link of {XDP_PROGRAM} on {}", iface.name))(boxed(e)))?;
        link.pin(&pin).map_err(|e| {
            bpf(format!("pinning {XDP_PROGRAM}'s link on {}", iface.name))(boxed(e))
        })?;
        out.added.push(pin_name);
        Ok(())
    }
}

impl NodePort {
    fn xdp_program(&mut self) -> Result<&mut Xdp, SocketLbError> {
        program_as(self.xdp_obj.as_mut().ok_or_else(no_xdp)?, XDP_PROGRAM)
    }
}

fn no_xdp() -> SocketLbError {
    SocketLbError::Bpf {
        what: format!("program {XDP_PROGRAM}"),
        message: "xdp.o is not loaded (--bpf-lb-acceleration is disabled)".into(),
    }
}

/// Loads one of the datapath's objects over the maps pinned in `pin_dir`
/// (every map is pinned by name: tc.o and xdp.o share them).
fn load(pin_dir: &Path, cap: Capacity, object: &[u8], what: &str) -> Result<Ebpf, SocketLbError> {
    if object.is_empty() {
        return Err(SocketLbError::Unsupported(
            "this binary was built without clang, so it has no BPF programs (apt-get install clang, then rebuild)".into(),
        ));
    }
    EbpfLoader::new()
        .default_map_pin_directory(pin_dir)
        .map_max_entries(SERVICES, cap.services)
        .map_max_entries(BACKENDS, cap.backends)
        .map_max_entries(MEMBERS, cap.backends)
        .load(object)
        .map_err(|e| bpf(format!("loading the {what} BPF object"))(boxed(e)))
}

fn gone(ifname: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(ifname) else {
        return true;
    };
    // SAFETY: a valid C string.
    unsafe { libc::if_nametoindex(c.as_ptr()) == 0 }
}

fn program<'a>(obj: &'a mut Ebpf, name: &str) -> Result<&'a mut SchedClassifier, SocketLbError> {
    program_as(obj, name)
}

/// The link pins under `dir`.
fn pinned(dir: &Path) -> Result<Vec<String>, SocketLbError> {
    if is_missing(dir) {
        return Ok(Vec::new());
    }
    let rd = std::fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))?;
    Ok(rd
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect())
}

/// Unpins every tc link (detaching the programs) and the tc programs' own
/// maps. True when something was there.
pub fn remove_nodeport(pin_dir: &Path) -> Result<bool, SocketLbError> {
    let dir = tc_dir(pin_dir);
    let mut removed = false;
    for name in pinned(&dir)? {
        removed |= remove_file(&dir.join(name))?;
    }
    removed |= remove_empty_dir(&dir)?;
    for m in NODEPORT_MAPS.iter().chain(&RETIRED_NODEPORT_MAPS) {
        removed |= remove_file(&pin_dir.join(m))?;
    }
    Ok(removed)
}
