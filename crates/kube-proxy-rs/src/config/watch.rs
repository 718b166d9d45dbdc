//! Upstream exits when its `--config` file changes, so that editing the
//! kube-proxy ConfigMap restarts the DaemonSet's pods onto the new settings
//! (cmd/kube-proxy/app/options.go: "content of the proxy server's
//! configuration file was updated"). Ours compares the file's text with the
//! one it loaded, once a second: a kubelet ConfigMap update swaps a symlink
//! rather than writing the file, and a rewrite of the same text changes
//! nothing, so the content is what is watched.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::time::Duration;

/// How often the file is read again.
pub const POLL: Duration = Duration::from_secs(1);

/// The digest the loaded text is remembered by.
pub fn digest(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

#[derive(Debug, thiserror::Error)]
#[error("content of the proxy server's configuration file was updated ({path}); exiting so that the restart reads it")]
pub struct ConfigChanged {
    pub path: PathBuf,
}

/// Returns once `path`'s text no longer has `loaded`'s digest. A file that
/// cannot be read for a moment (a symlink being swapped) is read again at
/// the next poll.
pub async fn changed(path: PathBuf, loaded: u64) -> ConfigChanged {
    changed_every(path, loaded, POLL).await
}

/// [`changed`], reading every `poll`.
pub async fn changed_every(path: PathBuf, loaded: u64, poll: Duration) -> ConfigChanged {
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match tokio::fs::read_to_string(&path).await {
            Ok(text) if digest(&text) != loaded => return ConfigChanged { path },
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "reading the config file again")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_new_text_ends_the_wait_and_the_same_text_does_not() {
        const POLL: Duration = Duration::from_millis(20);
        let dir = std::env::temp_dir().join(format!("kp-configwatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.conf");
        std::fs::write(&path, "mode: iptables\n").unwrap();
        let w = tokio::spawn(changed_every(
            path.clone(),
            digest("mode: iptables\n"),
            POLL,
        ));
        tokio::time::sleep(POLL * 3).await;
        // Rewritten with the same text, and briefly missing: still waiting.
        std::fs::write(&path, "mode: iptables\n").unwrap();
        tokio::time::sleep(POLL * 2).await;
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(POLL * 2).await;
        assert!(!w.is_finished());
        std::fs::write(&path, "mode: nftables\n").unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.path, path);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
