//! `ebpf-proxy cleanup`: unpins the agent's program links and its maps,
//! waits until the kernel has really let go of each link, then removes the
//! directory if it is left empty. Nothing the agent did not create is
//! touched: only pins in `<root>/links` (a directory only the agent writes)
//! and the maps the agent pins by name; anything else is reported and left.
//!
//! The wait matters: bpffs drops an unpinned link only after an RCU grace
//! period and a deferred work item, so right after the unlink the program can
//! still be on the hook. An operator who runs `cleanup` and then installs
//! kube-proxy must not race our program.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::programs::{
    SchedClassifier, TcAttachType,
    links::{FdLink, PinnedLink},
    loaded_links,
};

use crate::{
    attach::HOOKS,
    maps::{PINNED_MAPS, links_dir},
};

const DETACH_TIMEOUT: Duration = Duration::from_secs(10);

/// A link we unpinned.
struct Unpinned {
    path: PathBuf,
    link_id: u32,
    program_id: u32,
    /// For TC links, the hook they hold the program on (from the pin's name).
    tc_hook: Option<(u32, TcAttachType)>,
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
            let path = e.path();
            // A pin that is not a link (or is unreadable) is still ours to remove.
            let info = PinnedLink::from_pin(&path).ok().and_then(|p| FdLink::from(p).info().ok());
            std::fs::remove_file(&path).with_context(|| format!("unpin {}", path.display()))?;
            removed += 1;
            if let Some(info) = info {
                let tc_hook = tc_hook(&e.file_name().to_string_lossy());
                unpinned.push(Unpinned { path, link_id: info.id(), program_id: info.program_id(), tc_hook });
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
    if std::fs::remove_dir(root).is_err() {
        let mut left: Vec<String> =
            std::fs::read_dir(root).into_iter().flatten().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        println!("left in place under {} (not pinned by ebpf-proxy): {}", root.display(), left.join(", "));
    }
    if removed == 0 {
        println!("nothing of ours under {}", root.display());
    } else {
        println!("removed {removed} pinned objects under {}", root.display());
    }
    wait_released(&unpinned)
}

/// `<hook>-<ifindex>`, the agent's names for TC link pins (attach::HOOKS).
fn tc_hook(name: &str) -> Option<(u32, TcAttachType)> {
    HOOKS.iter().find_map(|(_, attach_type, hook)| {
        let ifindex = name.strip_prefix(hook)?.strip_prefix('-')?.parse::<u32>().ok()?;
        Some((ifindex, *attach_type))
    })
}

/// Polls until the kernel has released every unpinned link and, for TC
/// links, taken our program off the hook. A running agent still holds its
/// links, so that is the usual reason this times out.
fn wait_released(unpinned: &[Unpinned]) -> Result<()> {
    let deadline = Instant::now() + DETACH_TIMEOUT;
    loop {
        let live: BTreeSet<u32> = loaded_links().filter_map(Result::ok).map(|l| l.id()).collect();
        let still: Vec<&Unpinned> = unpinned.iter().filter(|u| live.contains(&u.link_id) || on_hook(u)).collect();
        if still.is_empty() {
            println!("released {} program links", unpinned.len());
            return Ok(());
        }
        if Instant::now() >= deadline {
            let list: Vec<String> =
                still.iter().map(|u| format!("{} (link {}, program {})", u.path.display(), u.link_id, u.program_id)).collect();
            bail!(
                "pins removed, but the kernel still holds {} after {DETACH_TIMEOUT:?}: is an agent still running with this --bpffs-root? Our programs stay attached until it exits",
                list.join(", ")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn on_hook(u: &Unpinned) -> bool {
    let Some((ifindex, attach)) = u.tc_hook else { return false };
    // An error here means the interface is gone, which detaches everything.
    SchedClassifier::query_tcx(ifindex, attach)
        .map(|(_, progs)| progs.iter().any(|p| p.id() == u.program_id))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_pin_names() {
        assert!(matches!(tc_hook("ingress-7"), Some((7, TcAttachType::Ingress))));
        assert!(matches!(tc_hook("egress-12"), Some((12, TcAttachType::Egress))));
        assert!(tc_hook("xdp-3").is_none());
        assert!(tc_hook("ingress-x").is_none());
    }
}
