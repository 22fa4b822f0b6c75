//! kapisrv, the real Kubernetes API server the tests of the Kubernetes
//! source run against (tests/kapisrv, tests/src/kapisrv.rs): built by its
//! build.sh from pinned Debian .debs into `~/.cache/kapisrv` — a no-op when
//! that is up to date, about five minutes when cold.

use std::{
    io::{BufRead as _, BufReader},
    path::PathBuf,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::cargo::workspace_root;

/// The test binaries that start kapisrv (`./x vm-test` builds it for them).
pub const TESTS: &[&str] = &["kube_api"];

/// Runs tests/kapisrv/build.sh, its progress on stderr, and returns the
/// directory holding the `kapisrv` and `etcd` binaries.
pub fn ensure() -> Result<PathBuf> {
    let script = workspace_root().join("tests/kapisrv/build.sh");
    eprintln!("==> kapisrv: tests/kapisrv/build.sh (cached in ~/.cache/kapisrv; a cold build takes about 5 minutes)");
    let started = Instant::now();
    let mut child = Command::new(&script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {}", script.display()))?;
    let mut kapisrv = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line?;
        match line.strip_prefix("kapisrv=") {
            Some(path) => kapisrv = Some(PathBuf::from(path)),
            None if line.starts_with("[build] up to date") || line.starts_with("etcd=") => {}
            None => eprintln!("==> kapisrv: {}", line.trim_start_matches("[build] ")),
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{} failed ({status})", script.display());
    }
    let kapisrv = kapisrv.with_context(|| format!("no kapisrv= line from {}", script.display()))?;
    let dir = kapisrv.parent().context("kapisrv path has no directory")?.to_path_buf();
    eprintln!("==> kapisrv: {} ({:.1}s)", dir.display(), started.elapsed().as_secs_f64());
    Ok(dir)
}

/// `ensure` on a thread of its own, so a cold build overlaps cargo's.
pub fn ensure_in_background() -> std::thread::JoinHandle<Result<PathBuf>> {
    std::thread::spawn(ensure)
}
