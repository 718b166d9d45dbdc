//! The nfacct objects iptables mode's rules count into (`-m nfacct`), over
//! nfnetlink_acct: created at the first sync, read on every /metrics scrape,
//! as upstream's kube-proxy does (pkg/proxy/util/nfacct). They belong to the
//! network namespace of the calling thread and outlive the process, so a
//! restart keeps counting from where the last run stopped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kp_netlink::{message, Attrs, ParsedAttrs, Protocol, Socket, Until, NLM_F_ACK, NLM_F_REQUEST};

/// Packets the INVALID drop in KUBE-FORWARD dropped
/// (kubeproxy_iptables_ct_state_invalid_dropped_packets_total).
pub const CT_STATE_INVALID_DROPPED: &str = "ct_state_invalid_dropped_pkts";
/// Packets to a NodePort on 127.0.0.0/8
/// (kubeproxy_iptables_localhost_nodeports_accepted_packets_total).
pub const LOCALHOST_NODEPORTS_ACCEPTED: &str = "localhost_nps_accepted_pkts";
/// Both, in the order they are created.
pub const COUNTERS: [&str; 2] = [CT_STATE_INVALID_DROPPED, LOCALHOST_NODEPORTS_ACCEPTED];

const NFNL_SUBSYS_ACCT: u16 = 7;
const NFNL_MSG_ACCT_NEW: u16 = 0;
const NFNL_MSG_ACCT_GET: u16 = 1;
const NFACCT_NAME: u16 = 1;
const NFACCT_PKTS: u16 = 2;
/// The kernel's NFACCT_NAME_MAX, NUL included.
const NAME_MAX: usize = 32;

/// Set once an iptables proxier of this process made the counters: only
/// then does /metrics export them (upstream: in iptables mode only).
static ENSURED: AtomicBool = AtomicBool::new(false);

#[derive(Debug, thiserror::Error)]
pub enum NfacctError {
    #[error("nfacct counter name {0:?} is not 1-31 bytes")]
    Name(String),
    #[error("nfacct counter {name}: {source}")]
    Netlink {
        name: String,
        #[source]
        source: kp_netlink::Error,
    },
    #[error("nfacct counter {0}: the kernel's answer has no packet count")]
    NoCount(String),
}

fn request(ty: u16, flags: u16, name: &str) -> Result<Vec<kp_netlink::Reply>, NfacctError> {
    if name.is_empty() || name.len() >= NAME_MAX {
        return Err(NfacctError::Name(name.to_string()));
    }
    let err = |source: kp_netlink::Error| NfacctError::Netlink {
        name: name.to_string(),
        source,
    };
    let mut s = Socket::open(Protocol::Netfilter).map_err(|e| err(e.into()))?;
    // A kernel without nfnetlink_acct never answers: do not hang a scrape.
    s.set_recv_timeout(Duration::from_secs(2))
        .map_err(|e| err(e.into()))?;
    let seq = s.next_seq();
    let mut a = Attrs::new();
    a.str(NFACCT_NAME, name);
    // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, res_id 0.
    let msg = message(
        (NFNL_SUBSYS_ACCT << 8) | ty,
        NLM_F_REQUEST | NLM_F_ACK | flags,
        seq,
        &[0u8; 4],
        &a,
    );
    s.request(&msg, seq, Until::Ack).map_err(err)
}

/// Creates counter `name` unless it exists (its counts are kept then).
pub fn ensure(name: &str) -> Result<(), NfacctError> {
    match request(NFNL_MSG_ACCT_NEW, kp_netlink::NLM_F_CREATE, name) {
        Ok(_) => Ok(()),
        // Without NLM_F_REPLACE an existing object answers EBUSY (EEXIST
        // with NLM_F_EXCL): it is there, which is all we need.
        Err(NfacctError::Netlink { source, .. })
            if matches!(source.errno(), Some(libc::EBUSY | libc::EEXIST)) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Creates both counters; true when both exist afterwards. A kernel
/// without nfacct support gets rules without `-m nfacct`, as upstream.
pub fn ensure_all() -> bool {
    let mut ok = true;
    for name in COUNTERS {
        if let Err(e) = ensure(name) {
            tracing::error!(error = %e, "cannot create the nfacct counter; its metric will not be exported");
            ok = false;
        }
    }
    if ok {
        ENSURED.store(true, Ordering::Relaxed);
    }
    ok
}

/// Whether a proxier of this process created the counters.
pub fn ensured() -> bool {
    ENSURED.load(Ordering::Relaxed)
}

/// The packets counter `name` has counted.
pub fn packets(name: &str) -> Result<u64, NfacctError> {
    let replies = request(NFNL_MSG_ACCT_GET, 0, name)?;
    replies
        .iter()
        .filter_map(|r| r.payload().get(4..))
        .find_map(|attrs| {
            let a = ParsedAttrs::parse(attrs);
            let v: [u8; 8] = a.get(NFACCT_PKTS)?.get(..8)?.try_into().ok()?;
            Some(u64::from_be_bytes(v))
        })
        .ok_or_else(|| NfacctError::NoCount(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_kernel_cannot_hold_are_refused_before_asking_it() {
        assert!(matches!(ensure(""), Err(NfacctError::Name(_))));
        let long = "x".repeat(NAME_MAX);
        let e = packets(&long).unwrap_err();
        assert!(e.to_string().contains("1-31 bytes"), "{e}");
    }
}
