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

/// A short random suffix: interface names are limited to 15 bytes.
pub fn unique_suffix() -> String {
    format!("{:05x}", rand::random::<u32>() & 0xfffff)
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
