//! The VM's userland: bookworm (the host binaries are linked against its
//! glibc, 2.36) with what the tests run besides themselves, built once with
//! mmdebstrap and cached as a cpio archive under a name derived from
//! everything that went into it.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::{debian::remove_matching, initrd};
use crate::image::sha256_hex;

pub const SUITE: &str = "bookworm";

/// `essential` (dpkg's Essential: yes set: sh, bash, coreutils, util-linux's
/// setpriv, ...) plus these: `ip`/`tc`, `ethtool`, `modprobe`, `sysctl`,
/// `mount`, the shared libraries the test binaries link, the CA store
/// without which the agent's Kubernetes client (rustls with the platform
/// verifier) refuses to start, and `curl`, `openssl` and `awk`, with which
/// kapisrv's scripts (tests/kapisrv) make certificates, wait for readiness
/// and find their processes.
pub const PACKAGES: &[&str] = &["iproute2", "ethtool", "kmod", "procps", "mount", "libgcc-s1", "ca-certificates", "curl", "openssl", "mawk"];

/// Nobody reads documentation in the VM; leaving it out halves the archive.
const DPKG_OPTS: &[&str] = &[
    "path-exclude=/usr/share/doc/*",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
];

/// The cached root filesystem archive, built first if needed (needs root).
pub fn ensure(cache: &Path, mirror: &str) -> Result<PathBuf> {
    let version = Command::new("mmdebstrap")
        .arg("--version")
        .output()
        .context("running mmdebstrap (package mmdebstrap; ./x vm-test installs it)")?;
    let key = sha256_hex(
        format!(
            "{SUITE} essential {PACKAGES:?} {DPKG_OPTS:?} {} {}",
            String::from_utf8_lossy(&version.stdout).trim(),
            initrd::FORMAT
        )
        .as_bytes(),
    );
    let prefix = format!("rootfs-{SUITE}-");
    let path = cache.join(format!("{prefix}{}.cpio", &key[..16]));
    if path.exists() {
        return Ok(path);
    }

    eprintln!("==> vm-test: building the {SUITE} root filesystem with mmdebstrap (once; about a minute)");
    let tmp = tempfile::tempdir_in(cache)?;
    let root = tmp.path().join("root");
    let mut cmd = Command::new("mmdebstrap");
    cmd.args(["--quiet", "--mode=root", "--variant=essential"])
        .arg(format!("--include={}", PACKAGES.join(",")))
        .args(DPKG_OPTS.iter().map(|o| format!("--dpkgopt={o}")))
        .arg(SUITE)
        .arg(&root)
        .arg(mirror);
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    remove_matching(cache, &prefix);
    initrd::cpio(&root, &path)?;
    eprintln!("==> vm-test: root filesystem {} ({} MB)", path.display(), fs::metadata(&path)?.len() / 1_000_000);
    Ok(path)
}
