//! One agent per `--bpffs-root`. Two agents on one root would reconcile the
//! same pinned maps, each with its own ID allocator, and overwrite each
//! other's backends. An agent holds an exclusive flock(2) on the root
//! directory itself for as long as it runs; the kernel drops the lock with
//! the last descriptor, however the process ends (SIGKILL and OOM kills
//! included), so a successor never meets a stale lock. `cleanup` takes the
//! same lock: it cannot run under an agent, nor an agent start mid-cleanup.

use std::{
    fs::{File, TryLockError},
    io::ErrorKind,
    os::unix::fs::MetadataExt,
    path::Path,
};

use anyhow::{Context, Result, bail};

/// Held while the agent (or cleanup) works on a root; dropping it unlocks.
#[derive(Debug)]
pub struct RootLock {
    _dir: File,
}

/// What trying the lock found.
#[derive(Debug)]
pub enum Lock {
    Taken(RootLock),
    /// Another process holds it: "ebpf-proxy (pid 42)", or what can be said
    /// of a holder this PID namespace cannot see.
    HeldBy(String),
    /// The directory does not exist (any more).
    Gone,
}

/// Tries the lock on `root` once, without waiting.
pub fn try_lock(root: &Path) -> Result<Lock> {
    let dir = match File::open(root) {
        Ok(d) => d,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Lock::Gone),
        Err(e) => return Err(e).with_context(|| format!("--bpffs-root {}: cannot open to lock it", root.display())),
    };
    match dir.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => return Ok(Lock::HeldBy(holder(&dir))),
        Err(TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("--bpffs-root {}: cannot lock", root.display()));
        }
    }
    // cleanup may have removed the directory between our open and our lock:
    // a lock on a deleted directory guards nothing.
    let locked = dir.metadata()?;
    match std::fs::metadata(root) {
        Ok(now) if (now.dev(), now.ino()) == (locked.dev(), locked.ino()) => Ok(Lock::Taken(RootLock { _dir: dir })),
        _ => Ok(Lock::Gone),
    }
}

/// For `run`: creates the root (on a bpffs) if needed and locks it, or
/// fails naming the agent that holds it and what to do.
pub fn acquire(root: &Path) -> Result<RootLock> {
    // Gone again only if cleanup removed it just now; a few tries settle that.
    for _ in 0..3 {
        crate::maps::ensure_bpffs(root)?;
        match try_lock(root)? {
            Lock::Taken(lock) => return Ok(lock),
            Lock::HeldBy(holder) => bail!(
                "--bpffs-root {} is in use by another agent, {holder}: one agent per root. Stop that one first, \
                 or give this one a --bpffs-root of its own",
                root.display()
            ),
            Lock::Gone => continue,
        }
    }
    bail!("--bpffs-root {}: removed each time it was created (is `ebpf-proxy cleanup` running in a loop?)", root.display())
}

/// Who holds the flock on `dir`, from /proc/locks (which names the locking
/// process in our PID namespace, or pid 0 when it is outside it).
fn holder(dir: &File) -> String {
    let Ok(meta) = dir.metadata() else { return "another process".into() };
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    match flock_pid(&locks, meta.dev(), meta.ino()) {
        Some(pid) if pid > 0 => {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            match comm.trim() {
                "" => format!("pid {pid}"),
                name => format!("{name} (pid {pid})"),
            }
        }
        Some(_) => "a process outside this PID namespace (an agent in a container?)".into(),
        None => "another process".into(),
    }
}

/// The PID of the FLOCK on device `dev`, inode `ino` in /proc/locks text
/// (`1: FLOCK  ADVISORY  WRITE 4242 00:2d:1234 0 EOF`; waiters have `->`).
fn flock_pid(locks: &str, dev: u64, ino: u64) -> Option<i64> {
    let id = format!("{:02x}:{:02x}:{ino}", nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, "FLOCK", _, _, pid, file, ..] if *file == id => pid.parse().ok(),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_locks_lines() {
        let dev = nix::sys::stat::makedev(0, 0x2d);
        let text = "1: POSIX  ADVISORY  WRITE 7 00:2d:99 0 EOF\n\
                    2: FLOCK  ADVISORY  WRITE 4242 00:2d:99 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 4343 00:2d:99 0 EOF\n\
                    3: FLOCK  ADVISORY  WRITE 0 00:2d:100 0 EOF\n";
        assert_eq!(flock_pid(text, dev, 99), Some(4242), "the holder, not a POSIX lock or a waiter");
        assert_eq!(flock_pid(text, dev, 100), Some(0), "a holder in another PID namespace");
        assert_eq!(flock_pid(text, dev, 101), None);
        assert_eq!(flock_pid(text, nix::sys::stat::makedev(0xfe, 0), 99), None, "another device");
    }

    /// flock conflicts between two opens even in one process: the second
    /// is refused, naming this process, until the first is dropped.
    #[test]
    fn a_second_lock_is_refused_naming_the_holder_until_the_first_goes() {
        let dir = tempfile::tempdir().unwrap();
        let Lock::Taken(first) = try_lock(dir.path()).unwrap() else { panic!("the first lock was not taken") };
        match try_lock(dir.path()).unwrap() {
            Lock::HeldBy(holder) => assert!(holder.ends_with(&format!("(pid {})", std::process::id())), "{holder}"),
            other => panic!("a second lock: {other:?}"),
        }
        drop(first);
        assert!(matches!(try_lock(dir.path()).unwrap(), Lock::Taken(_)));
        assert!(matches!(try_lock(&dir.path().join("missing")).unwrap(), Lock::Gone));
    }
}
