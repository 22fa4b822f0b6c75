//! Test hosts for ebpf-proxy: network namespaces joined by veths, echo
//! servers and clients that run inside them, a bpffs of their own, and the
//! agent started in a node namespace. Used by the integration tests in
//! `tests/` and by `cargo xtask demo`.
//!
//! Every resource is named with a per-run suffix, so two runs never collide,
//! and removed on drop, so a failing test leaves nothing behind.

// libtest's runner API, for harness.rs (the toolchain is a pinned nightly).
#![feature(test)]
extern crate test;

pub mod addrs;
pub mod agent;
pub mod bench;
pub mod bpf_ids;
pub mod bpf_unit;
pub mod bpffs;
pub mod cgroup;
pub mod conformance;
pub mod demo;
pub mod echo;
pub mod fixture;
pub mod flood;
pub mod flows;
pub mod frames;
pub mod harness;
pub mod hooks;
pub mod kapisrv;
pub mod manifests;
pub mod netns;
pub mod sctp;
pub mod sctp_bench;
pub mod topology;
pub mod tun_link;

/// A short random suffix: interface names are limited to 15 bytes. Never
/// one this process handed out before (tests run side by side in it), nor
/// one a network namespace of another run carries now (`ep<suffix>-...`):
/// 20 random bits alone let two of a conformance run's ~900 worlds meet.
pub fn unique_suffix() -> String {
    static ISSUED: std::sync::Mutex<std::collections::BTreeSet<u32>> = std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut issued = ISSUED.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let n = rand::random::<u32>() & 0xfffff;
        let suffix = format!("{n:05x}");
        if issued.insert(n) && !netns_named_with(&suffix) {
            return suffix;
        }
    }
}

/// Whether a network namespace's name holds `suffix` (in /run/netns).
fn netns_named_with(suffix: &str) -> bool {
    std::fs::read_dir("/run/netns")
        .map(|dir| dir.flatten().any(|e| e.file_name().to_string_lossy().contains(suffix)))
        .unwrap_or(false)
}

/// Runs a command and fails with its stderr if it fails.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("{program}: {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A deadline stretched by `EBPF_PROXY_TEST_PATIENCE` (a factor, default
/// 1): `./x vm-test` sets it where the VM is emulated (TCG runs the same
/// work several times slower). Deadlines only: no test measures time.
pub fn patience(deadline: std::time::Duration) -> std::time::Duration {
    let factor = std::env::var("EBPF_PROXY_TEST_PATIENCE").ok().and_then(|f| f.parse::<f64>().ok()).unwrap_or(1.0);
    deadline.mul_f64(factor.max(1.0))
}

/// Whether this process may create namespaces and load BPF programs.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

#[cfg(test)]
mod tests {
    /// 5,000 draws of 20 random bits repeat one with near certainty
    /// (birthday bound); handed-out suffixes must not.
    #[test]
    fn suffixes_never_repeat_within_a_run() {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..5000 {
            let s = super::unique_suffix();
            assert_eq!(s.len(), 5, "{s}");
            assert!(seen.insert(s.clone()), "{s} handed out twice");
        }
    }
}
