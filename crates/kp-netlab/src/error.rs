//! Error types of the lab: [`LabError`] for setup and process management,
//! [`ConnError`] for the outcome of a client connection attempt.

use std::io;

/// Something went wrong while building or driving the lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// An external command (normally `ip`) ran but exited unsuccessfully.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    /// An external command could not be started at all.
    #[error("could not start `{cmd}`: {source}")]
    Spawn {
        cmd: String,
        #[source]
        source: io::Error,
    },
    /// Entering or using a network namespace failed.
    #[error("network namespace {ns:?}: {what}: {source}")]
    Netns {
        ns: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// A node index outside `1..=nodes` was used.
    #[error("node {node} does not exist (the cluster has nodes 1..={nodes})")]
    NoSuchNode { node: usize, nodes: usize },
    /// A user-supplied name cannot be used (namespace, pod or server name).
    #[error("invalid {kind} name {name:?}: {why}")]
    InvalidName {
        kind: &'static str,
        name: String,
        why: &'static str,
    },
    /// Every pod address of a node is taken.
    #[error("node {node} has no free pod address left")]
    PodsExhausted { node: usize },
    /// Invalid cluster options.
    #[error("invalid cluster options: {0}")]
    Options(String),
    /// A local I/O operation (socket, file) failed.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// Why a client could not talk to a server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnError {
    /// Actively rejected: TCP reset / `ECONNREFUSED` (also what an ICMP
    /// port-unreachable turns into), ICMP host/net unreachable or
    /// admin-prohibited (`EHOSTUNREACH`/`ENETUNREACH`), including "no route"
    /// in the client's own namespace, or a reset of an established connection.
    #[error("connection refused or unreachable")]
    Refused,
    /// Nothing answered within the timeout (dropped packets, black hole).
    #[error("timed out")]
    Timeout,
    /// Anything else (unexpected errno, malformed reply, peer closed early...).
    #[error("{0}")]
    Other(String),
}

impl ConnError {
    /// Classifies an I/O error of a client socket; `what` names the step for
    /// [`ConnError::Other`].
    pub(crate) fn from_io(what: &str, e: &io::Error) -> ConnError {
        match e.raw_os_error() {
            Some(
                libc::ECONNREFUSED
                | libc::EHOSTUNREACH
                | libc::ENETUNREACH
                | libc::ECONNRESET
                | libc::EPIPE,
            ) => ConnError::Refused,
            Some(libc::ETIMEDOUT | libc::EAGAIN | libc::EINPROGRESS) => ConnError::Timeout,
            _ => match e.kind() {
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ConnError::Timeout,
                _ => ConnError::Other(format!("{what}: {e}")),
            },
        }
    }

    /// True for [`ConnError::Refused`].
    pub fn is_refused(&self) -> bool {
        matches!(self, ConnError::Refused)
    }

    /// True for [`ConnError::Timeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, ConnError::Timeout)
    }
}
