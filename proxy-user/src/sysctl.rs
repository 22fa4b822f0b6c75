//! The one sysctl the agent sets: `net.ipv4.conf.lo.accept_local=1`.
//!
//! The node's own packets to one of its own addresses (a NodePort on the
//! node's IP) that no socket hook translated (a raw socket, a process
//! outside --cgroup-root, SCTP) are translated at loopback's egress and sent
//! to the backend. Their replies must reach the node's socket from the
//! frontend, one of the node's own addresses, so tc_ingress_node_reply
//! hands them in through loopback. Linux refuses a packet from one of its
//! own addresses unless the interface accepts local sources (a martian
//! source otherwise). On loopback that admits nothing from outside: only
//! the node, and our programs, put packets there. IPv6 has no such check.
//!
//! A container's /proc/sys is read-only, so the DaemonSet mounts the host's
//! /proc/sys/net under `--sysctl-root`, as Cilium mounts the host's /proc.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tracing::{info, warn};

fn accept_local_path(sysctl_root: &Path) -> PathBuf {
    sysctl_root.join("net/ipv4/conf/lo/accept_local")
}

/// Sets it if needed: Ok(true) if it was set here, Ok(false) if it already was.
pub fn accept_local_on_loopback(sysctl_root: &Path) -> Result<bool> {
    let path = accept_local_path(sysctl_root);
    let now = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    if now.trim() == "1" {
        return Ok(false);
    }
    std::fs::write(&path, "1").with_context(|| format!("write 1 to {}", path.display()))?;
    Ok(true)
}

/// As `accept_local_on_loopback`, a failure logged with what it costs: the
/// agent serves everything else.
pub fn accept_local_on_loopback_or_warn(sysctl_root: &Path) {
    match accept_local_on_loopback(sysctl_root) {
        Ok(true) => info!(sysctl = "net.ipv4.conf.lo.accept_local", value = 1, "sysctl set"),
        Ok(false) => {}
        Err(e) => warn!(
            "cannot set net.ipv4.conf.lo.accept_local=1 ({e:#}): the node's own connections to its own NodePorts that \
             no socket hook translates (raw sockets, processes outside --cgroup-root, SCTP) get no replies. Point \
             --sysctl-root at a writable mount of the host's /proc/sys (deploy/daemonset.yaml mounts /proc/sys/net)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_it_once_and_says_what_failed() {
        let dir = tempfile::tempdir().unwrap();
        let path = accept_local_path(dir.path());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "0\n").unwrap();
        assert!(accept_local_on_loopback(dir.path()).unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "1");
        assert!(!accept_local_on_loopback(dir.path()).unwrap(), "already set");
        let missing = tempfile::tempdir().unwrap();
        let err = format!("{:#}", accept_local_on_loopback(missing.path()).unwrap_err());
        assert!(err.contains("net/ipv4/conf/lo/accept_local"), "{err}");
    }
}
