//! `ebpf-proxy cleanup`: unpins the agent's TC links and its maps, waits until
//! the kernel has really detached each program, then removes the directory if
//! it is left empty. Nothing the agent did not create is touched.
//!
//! The wait matters: bpffs drops an unpinned link only after an RCU grace
//! period and a deferred work item, so right after the unlink the program can
//! still be on the hook. An operator who runs `cleanup` and then installs
//! kube-proxy must not race our program.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::programs::{SchedClassifier, TcAttachType, links::{FdLink, PinnedLink}};

use crate::{attach::HOOKS, maps::{PINNED_MAPS, links_dir}};

const DETACH_TIMEOUT: Duration = Duration::from_secs(10);

/// A link we unpinned: the program it held on an interface's ingress hook.
struct Unpinned {
    attach_type: TcAttachType,
    ifindex: u32,
    program_id: u32,
}

pub fn cleanup(root: &Path) -> Result<()> {
    if !root.exists() {
        println!("nothing to clean: {} does not exist", root.display());
        return Ok(());
    }
    let mut removed = 0;
    let mut unpinned = Vec::new();
    let links = links_dir(root);
    if let Ok(entries) = std::fs::read_dir(&links) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // TC links are waited for below; socket hooks (cgroup-*) have no
            // per-interface hook to watch, their unpin is enough.
            let tc = HOOKS.iter().find_map(|(_, attach_type, hook)| {
                let ifindex = name.strip_prefix(hook)?.strip_prefix('-')?.parse::<u32>().ok()?;
                Some((*attach_type, ifindex))
            });
            // A pin that is not a link (or is unreadable) is still ours to remove.
            let program_id = PinnedLink::from_pin(e.path()).ok().and_then(|p| FdLink::from(p).info().ok()).map(|i| i.program_id());
            std::fs::remove_file(e.path()).with_context(|| format!("unpin {}", e.path().display()))?;
            removed += 1;
            if let (Some((attach_type, ifindex)), Some(program_id)) = (tc, program_id) {
                unpinned.push(Unpinned { attach_type, ifindex, program_id });
            }
        }
        let _ = std::fs::remove_dir(&links);
    }
    for name in PINNED_MAPS {
        let path = root.join(name);
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("unpin {}", path.display()))?;
            removed += 1;
        }
    }
    let _ = std::fs::remove_dir(root);
    println!("removed {removed} pinned objects under {}", root.display());
    wait_detached(&unpinned)
}

/// Polls each hook until the kernel has released our program from it (or
/// the interface is gone). A running agent still holds its links, so that
/// is the usual reason this times out.
fn wait_detached(unpinned: &[Unpinned]) -> Result<()> {
    let deadline = Instant::now() + DETACH_TIMEOUT;
    loop {
        let still: Vec<&Unpinned> = unpinned.iter().filter(|u| still_attached(u)).collect();
        if still.is_empty() {
            println!("detached {} program links", unpinned.len());
            return Ok(());
        }
        if Instant::now() >= deadline {
            let list: Vec<String> =
                still.iter().map(|u| format!("ifindex {} {:?} (program {})", u.ifindex, u.attach_type, u.program_id)).collect();
            bail!(
                "the kernel still runs our program on {} after {DETACH_TIMEOUT:?}; is an agent still running with this --bpffs-root?",
                list.join(", ")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn still_attached(u: &Unpinned) -> bool {
    // An error here means the interface is gone, which detaches everything.
    SchedClassifier::query_tcx(u.ifindex, u.attach_type)
        .map(|(_, progs)| progs.iter().any(|p| p.id() == u.program_id))
        .unwrap_or(false)
}
