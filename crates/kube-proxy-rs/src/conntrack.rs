//! Deleting stale UDP conntrack entries after endpoints change.

use std::process::Command;

use kp_model::{IpFamily, StaleConntrack};

/// Deletes conntrack entries matching filters; returns how many went.
pub trait Conntrack: Send {
    fn delete(&mut self, family: IpFamily, filters: &[StaleConntrack]) -> u64;
}

/// The `conntrack` program (conntrack-tools). First cut; the filters are
/// the same a netlink implementation takes.
pub struct ConntrackCli;

impl Conntrack for ConntrackCli {
    fn delete(&mut self, family: IpFamily, filters: &[StaleConntrack]) -> u64 {
        let mut total = 0;
        for f in filters {
            let mut args: Vec<String> = vec![
                "-D".into(),
                "-f".into(),
                match family {
                    IpFamily::V4 => "ipv4".into(),
                    IpFamily::V6 => "ipv6".into(),
                },
                "-p".into(),
                f.protocol.as_lower().into(),
                "--orig-port-dst".into(),
                f.orig_dport.to_string(),
            ];
            if let Some(ip) = f.orig_dst {
                args.push("--orig-dst".into());
                args.push(ip.to_string());
            }
            if let Some(ip) = f.reply_src {
                args.push("--reply-src".into());
                args.push(ip.to_string());
            }
            match Command::new("conntrack").args(&args).output() {
                Ok(out) => {
                    // "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted."
                    let text = String::from_utf8_lossy(&out.stderr);
                    let n = text
                        .split_whitespace()
                        .collect::<Vec<_>>()
                        .windows(2)
                        .find(|w| w[1] == "flow")
                        .and_then(|w| w[0].parse::<u64>().ok())
                        .unwrap_or(0);
                    tracing::debug!(filter = ?f, deleted = n, "conntrack cleanup");
                    total += n;
                }
                Err(e) => tracing::warn!(error = %e, "running conntrack failed"),
            }
        }
        total
    }
}
