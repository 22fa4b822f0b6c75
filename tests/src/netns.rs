//! A network namespace that is deleted on drop, and a way to run code in it.

use std::{fs::File, sync::Arc, thread};

use anyhow::{Context, Result};
use nix::sched::{CloneFlags, setns};

use crate::{cgroup::TestRoot, run};

pub struct Netns {
    pub name: String,
    /// Every test world lives under the hooked cgroup root (see cgroup.rs)
    /// for as long as any of its namespaces does, agent restarts included.
    _cgroup_root: Arc<TestRoot>,
}

impl Netns {
    pub fn new(name: &str) -> Result<Self> {
        let cgroup_root = TestRoot::get()?;
        run("ip", &["netns", "add", name])?;
        let ns = Netns { name: name.to_string(), _cgroup_root: cgroup_root };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip <args>` inside the namespace.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        run("ip", &full)
    }

    /// A command inside the namespace (`ip netns exec`).
    pub fn command(&self, program: &str) -> std::process::Command {
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let out = self.command("sysctl").args(["-qw", &format!("{key}={value}")]).output()?;
        anyhow::ensure!(out.status.success(), "sysctl {key}={value} in {}: {}", self.name, String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    /// Runs `f` on a new thread that has entered this namespace; sockets it
    /// creates live in the namespace even after the thread hands them out.
    pub fn spawn<F, R>(&self, f: F) -> Result<thread::JoinHandle<R>>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let file = File::open(format!("/run/netns/{}", self.name))
            .with_context(|| format!("open netns {}", self.name))?;
        let name = self.name.clone();
        Ok(thread::spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("setns {name}: {e}"));
            f()
        }))
    }

    /// As `run`, for an `f` that borrows (a scoped thread).
    pub fn run_borrowing<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R> {
        let file = File::open(format!("/run/netns/{}", self.name))
            .with_context(|| format!("open netns {}", self.name))?;
        thread::scope(|s| {
            s.spawn(|| {
                setns(&file, CloneFlags::CLONE_NEWNET).with_context(|| format!("setns {}", self.name))?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("thread in netns {} panicked", self.name))?
        })
    }

    /// Runs `f` in the namespace and waits for it.
    pub fn run<F, R>(&self, f: F) -> Result<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        self.spawn(f)?.join().map_err(|_| anyhow::anyhow!("thread in netns {} panicked", self.name))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.name]);
    }
}
