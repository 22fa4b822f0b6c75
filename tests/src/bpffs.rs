//! A private bpffs per test run, so pinned maps of one run never meet
//! another's, and unmounting removes every pin.
//!
//! `ip netns exec` remounts /sys, hiding /sys/fs/bpf from an agent started in
//! a namespace; a mount elsewhere stays visible.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::{run, unique_suffix};

pub struct Bpffs {
    pub path: PathBuf,
}

impl Bpffs {
    pub fn new(label: &str) -> Result<Self> {
        let path = std::env::temp_dir().join(format!("ebpf-proxy-{label}-{}", unique_suffix()));
        std::fs::create_dir_all(&path)?;
        let p = path.to_str().unwrap();
        if let Err(e) = run("mount", &["-t", "bpf", "bpf", p]) {
            let _ = std::fs::remove_dir(&path);
            return Err(e);
        }
        Ok(Bpffs { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.path.to_str().unwrap()]);
        let _ = std::fs::remove_dir(&self.path);
    }
}
