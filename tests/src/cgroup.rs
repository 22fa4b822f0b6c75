//! A private cgroup for one simulated node: the agent's socket hooks attach
//! to it, and "node processes" run inside it, so one test's hooks never see
//! another test's (or the machine's) processes. The cgroup v2 hierarchy is
//! mounted again under /tmp because `ip netns exec` remounts /sys.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{netns::Netns, run, unique_suffix};

pub struct Cgroup {
    mount: PathBuf,
    /// The node's cgroup, inside the mount.
    pub path: PathBuf,
}

impl Cgroup {
    pub fn new(label: &str) -> Result<Self> {
        let mount = std::env::temp_dir().join(format!("ebpf-proxy-cg-{label}-{}", unique_suffix()));
        std::fs::create_dir_all(&mount)?;
        if let Err(e) = run("mount", &["-t", "cgroup2", "none", mount.to_str().unwrap()]) {
            let _ = std::fs::remove_dir(&mount);
            return Err(e.context("mounting cgroup2 (cgroup v2 is needed for the socket hooks)"));
        }
        let path = mount.join(format!("ebpf-proxy-test-{label}-{}", unique_suffix()));
        let cg = Cgroup { mount, path };
        std::fs::create_dir(&cg.path).with_context(|| format!("create cgroup {}", cg.path.display()))?;
        Ok(cg)
    }

    pub fn path(&self) -> &Path {
        &self.path
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
        let _ = run("umount", &["-l", self.mount.to_str().unwrap()]);
        let _ = std::fs::remove_dir(&self.mount);
    }
}
