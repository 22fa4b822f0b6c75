//! The cgroups of the simulated nodes, laid out as kubelet lays out a real
//! node's: every agent's socket hooks go on one root, and everything the
//! tests run sits under it — the test process itself (whose threads play
//! the pods, the external hosts and the node's own in-process clients), the
//! agents, and each node's processes in a child cgroup. So pods' sockets
//! pass the hooks as they do in production, and only the hooks' own check
//! (a socket in the node's network namespace, see proxy-ebpf's sock.rs)
//! keeps them, and every other node's processes, out of an agent's
//! translation.
//!
//! The root lives while any test of this process uses it; the process then
//! moves back to the cgroup it started in and the root is removed. The
//! cgroup v2 hierarchy is mounted again under /tmp because `ip netns exec`
//! remounts /sys, and agents and node processes run through it.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex, Weak},
};

use anyhow::{Context, Result};

use crate::{netns::Netns, run, unique_suffix};

/// The hooked root shared by every test of this process.
pub struct TestRoot {
    mount: PathBuf,
    /// The root, inside the mount: every agent's default `--cgroup-root`.
    pub path: PathBuf,
    /// Where this process was before (relative to the mount).
    home: PathBuf,
}

static ROOT: Mutex<Weak<TestRoot>> = Mutex::new(Weak::new());

impl TestRoot {
    /// The process-wide root, created (and the process moved into it) on
    /// first use.
    pub fn get() -> Result<Arc<TestRoot>> {
        let mut current = ROOT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(root) = current.upgrade() {
            return Ok(root);
        }
        let root = Arc::new(TestRoot::create()?);
        *current = Arc::downgrade(&root);
        Ok(root)
    }

    fn create() -> Result<TestRoot> {
        let self_cgroup = std::fs::read_to_string("/proc/self/cgroup").context("read /proc/self/cgroup")?;
        let home = self_cgroup
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .context("this process is on no cgroup v2 hierarchy (the socket hooks need cgroup v2)")?;
        let home = PathBuf::from(home.trim_start_matches('/'));
        let mount = std::env::temp_dir().join(format!("ebpf-proxy-cg-{}", unique_suffix()));
        std::fs::create_dir_all(&mount)?;
        if let Err(e) = run("mount", &["-t", "cgroup2", "none", mount.to_str().unwrap()]) {
            let _ = std::fs::remove_dir(&mount);
            return Err(e.context("mounting cgroup2 (cgroup v2 is needed for the socket hooks)"));
        }
        let root = TestRoot { path: mount.join(format!("ebpf-proxy-test-{}-{}", std::process::id(), unique_suffix())), mount, home };
        std::fs::create_dir(&root.path).with_context(|| format!("create cgroup {}", root.path.display()))?;
        join(&root.path)?;
        Ok(root)
    }
}

impl Drop for TestRoot {
    fn drop(&mut self) {
        let current = ROOT.lock().unwrap_or_else(|e| e.into_inner());
        // A newer root may already hold the process: then it stays there.
        if current.upgrade().is_none() {
            let _ = join(&self.mount.join(&self.home));
        }
        let _ = std::fs::remove_dir(&self.path);
        let _ = run("umount", &["-l", self.mount.to_str().unwrap()]);
        let _ = std::fs::remove_dir(&self.mount);
    }
}

/// Moves this whole process (every thread) into `cgroup`.
fn join(cgroup: &Path) -> Result<()> {
    std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
        .with_context(|| format!("move the test process into {}", cgroup.display()))
}

/// The cgroup of one node's own processes: a child of the hooked root, as a
/// node's system services sit under the host's root. `outside` makes one
/// beside the root instead, for a process the hooks never see.
pub struct Cgroup {
    pub path: PathBuf,
    root: Arc<TestRoot>,
}

impl Cgroup {
    pub fn new(label: &str) -> Result<Self> {
        let root = TestRoot::get()?;
        Cgroup::create(root.path.join(format!("{label}-{}", unique_suffix())), root)
    }

    /// A cgroup outside the hooked root.
    pub fn outside(label: &str) -> Result<Self> {
        let root = TestRoot::get()?;
        Cgroup::create(root.mount.join(format!("ebpf-proxy-outside-{label}-{}", unique_suffix())), root)
    }

    fn create(path: PathBuf, root: Arc<TestRoot>) -> Result<Self> {
        std::fs::create_dir(&path).with_context(|| format!("create cgroup {}", path.display()))?;
        Ok(Cgroup { path, root })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The hooked root above it: the agents' `--cgroup-root`.
    pub fn root(&self) -> &Path {
        &self.root.path
    }

    /// `program args..` run as a process of this cgroup inside `ns`.
    pub fn command(&self, ns: &Netns, program: &Path) -> Command {
        // Join the cgroup first: inside `ip netns exec` this mount is the
        // only cgroup2 view left, and membership is inherited through exec.
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(r#"echo $$ > "$0/cgroup.procs" && exec ip netns exec "$1" "${@:2}""#)
            .arg(&self.path)
            .arg(&ns.name)
            .arg(program);
        cmd
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Processes that ran in it have exited by now; an empty cgroup goes.
        let _ = std::fs::remove_dir(&self.path);
    }
}
