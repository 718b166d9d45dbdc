//! What ipvs mode (ours or upstream's) leaves on a node, found and removed
//! over netlink: the kube-ipvs0 link (rtnetlink), the IPVS virtual servers
//! (generic netlink) and the ipsets (nfnetlink's ipset subsystem). Used by
//! `--cleanup` and by a start in another mode; the names live here, with the
//! mode that creates them, so the binary holds no copy of them and needs
//! none of `ip`, `ipvsadm` or `ipset`.

use std::io;

use kp_model::IpFamily;
use kp_netlink::{
    message, Attrs, ParsedAttrs, Protocol, Socket, Until, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};

use crate::ipset::{name as set_name, SETS};
use crate::ipvs::IpvsClient;
use crate::proxier::DUMMY_DEV;
use crate::rtnl::Rtnl;

/// Upstream's sets that our ipvs mode does not create (it matches source
/// IPs through KUBE-LOAD-BALANCER-SOURCE-CIDR only), but a node that ran
/// upstream may still hold.
pub const UPSTREAM_ONLY_SETS: [&str; 1] = ["KUBE-LOAD-BALANCER-SOURCE-IP"];

/// ipset names are at most this long (IPSET_MAXNAMELEN - 1).
const MAX_SET_NAME: usize = 31;

fn all_bases() -> impl Iterator<Item = &'static str> {
    SETS.iter()
        .map(|d| d.name)
        .chain(UPSTREAM_ONLY_SETS.iter().copied())
}

/// Whether `name` is one of ipvs mode's ipsets: upstream's IPv4 names, their
/// `KUBE-6-` IPv6 forms (whole, or cut at 31 characters as upstream does),
/// and our shortened IPv6 names.
pub fn is_ipvs_set(name: &str) -> bool {
    all_bases().any(|base| {
        let v6 = format!("KUBE-6-{}", &base["KUBE-".len()..]);
        name == base
            || name == v6
            || (v6.len() > MAX_SET_NAME && name == &v6[..MAX_SET_NAME])
            || name == set_name(base, IpFamily::V6)
    })
}

/// Deletes the kube-ipvs0 link; false when there was none.
pub fn remove_link() -> io::Result<bool> {
    let mut rtnl = Rtnl::open()?;
    match rtnl.link_index(DUMMY_DEV)? {
        Some(i) => rtnl.delete_link(i).map(|()| true),
        None => Ok(false),
    }
}

/// Deletes every IPVS virtual server (as `ipvsadm --clear`), returning how
/// many; None when the kernel has no IPVS (so there are none).
pub fn clear_virtual_servers() -> io::Result<Option<usize>> {
    let mut c = match IpvsClient::open() {
        Ok(c) => c,
        // No IPVS generic netlink family: the module is not loaded or built.
        Err(_) if !std::path::Path::new("/proc/net/ip_vs").exists() => return Ok(None),
        Err(e) => return Err(e),
    };
    let services = c.services()?;
    for (k, _) in &services {
        c.del_service(k)?;
    }
    Ok(Some(services.len()))
}

// nfnetlink's ipset subsystem (include/uapi/linux/netfilter/ipset/ip_set.h).
const NFNL_SUBSYS_IPSET: u16 = 6;
const IPSET_CMD_DESTROY: u16 = 3;
const IPSET_CMD_LIST: u16 = 7;
const IPSET_ATTR_PROTOCOL: u16 = 1;
const IPSET_ATTR_SETNAME: u16 = 2;
const IPSET_ATTR_FLAGS: u16 = 6;
/// Dump names only, not members.
const IPSET_FLAG_LIST_SETNAME: u32 = 1 << 1;
/// The protocol version every kernel since 5.3 speaks (ipset 7).
const IPSET_PROTOCOL: u8 = 7;
/// The kernel's "set is in use" (IPSET_ERR_BUSY): an iptables rule still
/// matches it.
pub const IPSET_ERR_BUSY: i32 = 4100;
const NFPROTO_IPV4: u8 = 2;

fn ipset_msg(cmd: u16, flags: u16, seq: u32, attrs: &Attrs) -> Vec<u8> {
    // nfgenmsg: family, version 0, resource id 0.
    let nfgen = [NFPROTO_IPV4, 0, 0, 0];
    message((NFNL_SUBSYS_IPSET << 8) | cmd, flags, seq, &nfgen, attrs)
}

/// The ipset messages the cleanup sends, separate from the socket so their
/// bytes are tested without a kernel.
pub mod msg {
    use super::*;

    /// Lists every set's name.
    pub fn list_names(seq: u32) -> Vec<u8> {
        let mut a = Attrs::new();
        a.u8(IPSET_ATTR_PROTOCOL, IPSET_PROTOCOL);
        a.u32be(IPSET_ATTR_FLAGS, IPSET_FLAG_LIST_SETNAME);
        ipset_msg(IPSET_CMD_LIST, NLM_F_REQUEST | NLM_F_DUMP, seq, &a)
    }

    /// Destroys the set `name`.
    pub fn destroy(seq: u32, name: &str) -> Vec<u8> {
        let mut a = Attrs::new();
        a.u8(IPSET_ATTR_PROTOCOL, IPSET_PROTOCOL);
        a.str(IPSET_ATTR_SETNAME, name);
        ipset_msg(IPSET_CMD_DESTROY, NLM_F_REQUEST | NLM_F_ACK, seq, &a)
    }
}

/// Why a set could not be destroyed.
#[derive(Debug, thiserror::Error)]
pub enum IpsetError {
    #[error("ipset {0} is in use (an iptables rule still matches it)")]
    Busy(String),
    #[error("ipset {name}: {source}")]
    Netlink {
        name: String,
        #[source]
        source: io::Error,
    },
}

/// The ipset subsystem over nfnetlink: list names, destroy sets.
pub struct Ipsets {
    sock: Socket,
}

impl Ipsets {
    pub fn open() -> io::Result<Ipsets> {
        Ok(Ipsets {
            sock: Socket::open(Protocol::Netfilter)?,
        })
    }

    /// Every set's name in this network namespace.
    pub fn names(&mut self) -> io::Result<Vec<String>> {
        let seq = self.sock.next_seq();
        let replies = self
            .sock
            .request(&msg::list_names(seq), seq, Until::Done)
            .map_err(|e| io::Error::other(format!("listing ipsets: {e}")))?;
        let mut out = Vec::new();
        for r in &replies {
            // After the 4-byte nfgenmsg.
            let Some(attrs) = r.payload().get(4..) else {
                continue;
            };
            if let Some(raw) = ParsedAttrs::parse(attrs).get(IPSET_ATTR_SETNAME) {
                let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
                out.push(String::from_utf8_lossy(&raw[..end]).into_owned());
            }
        }
        Ok(out)
    }

    /// Destroys `name`; a set that does not exist is not an error.
    pub fn destroy(&mut self, name: &str) -> Result<(), IpsetError> {
        let seq = self.sock.next_seq();
        match self.sock.request(&msg::destroy(seq, name), seq, Until::Ack) {
            Ok(_) => Ok(()),
            Err(e) => match e.errno() {
                Some(libc::ENOENT) => Ok(()),
                Some(IPSET_ERR_BUSY) => Err(IpsetError::Busy(name.to_string())),
                _ => Err(IpsetError::Netlink {
                    name: name.to_string(),
                    source: e.into(),
                }),
            },
        }
    }
}
