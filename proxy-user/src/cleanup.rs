//! `ebpf-proxy cleanup`: unpins the agent's program links and its maps,
//! removes its netlink filters (kernels without TCX) from every interface of
//! this network namespace, waits until the kernel has really let go of each
//! link, then removes the directory if it is left empty. Nothing the agent did not create is
//! touched: only pins in `<root>/links` (a directory only the agent writes)
//! and the maps the agent pins by name (the L3 devices' program arrays in
//! `<root>/l3`); anything else is reported and left.
//!
//! It refuses while an agent holds the root's lock (root_lock), or another
//! process (an agent of an older build, say) has our maps or links open, and
//! removes nothing then; it holds the lock itself, so no agent starts under
//! it. The wait matters: bpffs drops an unpinned link only after an RCU grace
//! period and a deferred work item, so right after the unlink the program can
//! still be on the hook. An operator who runs `cleanup` and then installs
//! kube-proxy must not race our program.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use aya::{
    maps::MapData,
    programs::{
        SchedClassifier, TcAttachType,
        links::{FdLink, LinkInfo, PinnedLink},
        loaded_links,
    },
};

use crate::{
    attach::HOOKS,
    maps::{l3_programs_dir, links_dir, map_pins},
    root_lock::{self, Lock},
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
    let _lock = match root_lock::try_lock(root)? {
        Lock::Taken(lock) => lock,
        Lock::HeldBy(holder) => {
            bail!("{holder} runs on --bpffs-root {}: stop the agent first (nothing was removed)", root.display())
        }
        Lock::Gone => {
            println!("nothing to clean: {} does not exist", root.display());
            return Ok(());
        }
    };
    let links = links_dir(root);
    let pins: Vec<(PathBuf, Option<LinkInfo>)> = std::fs::read_dir(&links)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            // A pin that is not a link (or is unreadable) is still ours to remove.
            let info = PinnedLink::from_pin(e.path()).ok().and_then(|p| FdLink::from(p).info().ok());
            (e.path(), info)
        })
        .collect();

    // A running agent holds its maps open (its links only through the pins):
    // cleaning under it would detach its programs while it carries on as if
    // attached. Refuse before touching anything.
    let ours = BpfIds {
        links: pins.iter().filter_map(|(_, i)| i.as_ref().map(LinkInfo::id)).collect(),
        maps: map_pins(root)
            .filter_map(|path| MapData::from_pin(path).ok()?.info().ok())
            .map(|i| i.id())
            .collect(),
    };
    let holders = holders(&ours);
    if !holders.is_empty() {
        bail!(
            "{} has the maps pinned under {} open: stop the agent first (nothing was removed)",
            holders.join(", "),
            root.display()
        );
    }

    let filters = remove_netlink_filters();
    let qdiscs = crate::clsact::remove_unused(root)?;
    if filters + qdiscs > 0 {
        println!("removed {filters} netlink filters and {qdiscs} clsact qdiscs the agent had added");
    }
    let mut removed = 0;
    let mut unpinned = Vec::new();
    for (path, info) in pins {
        std::fs::remove_file(&path).with_context(|| format!("unpin {}", path.display()))?;
        removed += 1;
        if let Some(info) = info {
            let tc_hook = path.file_name().and_then(|n| tc_hook(&n.to_string_lossy()));
            unpinned.push(Unpinned { path, link_id: info.id(), program_id: info.program_id(), tc_hook });
        }
    }
    let _ = std::fs::remove_dir(&links);
    for path in map_pins(root) {
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("unpin {}", path.display()))?;
            removed += 1;
        }
    }
    let _ = std::fs::remove_dir(l3_programs_dir(root));
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

/// Our cls_bpf filters (attach::NETLINK_PRIORITY/HANDLE) on every interface
/// of this network namespace, where the agent attached them on a kernel
/// without TCX. The clsact qdisc stays: it may hold others' filters, and an
/// empty one costs nothing. Returns how many were removed.
fn remove_netlink_filters() -> usize {
    let Ok(interfaces) = nix::net::if_::if_nameindex() else { return 0 };
    interfaces.iter().map(|i| crate::attach::detach_netlink_filters(i.index())).sum()
}

/// The kernel IDs of our pinned objects.
struct BpfIds {
    links: BTreeSet<u32>,
    maps: BTreeSet<u32>,
}

impl BpfIds {
    /// Whether an fd's /proc fdinfo (`map_id:` or `link_id:` line) names one of ours.
    fn in_fdinfo(&self, info: &str) -> bool {
        info.lines().any(|l| {
            let id = |prefix| l.strip_prefix(prefix).and_then(|v: &str| v.trim().parse::<u32>().ok());
            id("map_id:").is_some_and(|i| self.maps.contains(&i)) || id("link_id:").is_some_and(|i| self.links.contains(&i))
        })
    }
}

/// Other processes with one of our maps or links open, as "name (pid N)",
/// from /proc/*/fd and fdinfo. Only our PID namespace is seen; a holder
/// elsewhere shows up later, when the kernel does not release the links.
fn holders(ours: &BpfIds) -> Vec<String> {
    if ours.links.is_empty() && ours.maps.is_empty() {
        return Vec::new();
    }
    let me = std::process::id();
    let mut holders = Vec::new();
    for proc_entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = proc_entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let holds = std::fs::read_dir(proc_entry.path().join("fd")).into_iter().flatten().flatten().any(|fd| {
            let target = std::fs::read_link(fd.path()).unwrap_or_default();
            let bpf = matches!(target.to_str(), Some("anon_inode:bpf-map" | "anon_inode:bpf_link"));
            bpf && std::fs::read_to_string(proc_entry.path().join("fdinfo").join(fd.file_name()))
                .is_ok_and(|info| ours.in_fdinfo(&info))
        });
        if holds {
            let comm = std::fs::read_to_string(proc_entry.path().join("comm")).unwrap_or_default();
            holders.push(format!("{} (pid {pid})", comm.trim()));
        }
    }
    holders
}

/// `<hook>-<ifindex>`, the agent's names for TC link pins (attach::HOOKS).
fn tc_hook(name: &str) -> Option<(u32, TcAttachType)> {
    HOOKS.iter().find_map(|(_, attach_type, hook)| {
        let ifindex = name.strip_prefix(hook)?.strip_prefix('-')?.parse::<u32>().ok()?;
        Some((ifindex, *attach_type))
    })
}

/// Polls until the kernel has released every unpinned link and, for TC
/// links, taken our program off the hook.
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
                "pins removed, but the kernel still holds {} after {DETACH_TIMEOUT:?}: a process this PID namespace cannot see has them open (an agent in a container?); our programs stay attached until it closes them",
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
    fn fdinfo_ids() {
        let ours = BpfIds { links: [7].into(), maps: [42].into() };
        assert!(ours.in_fdinfo("pos:\t0\nflags:\t02000002\nmap_type:\t1\nmap_id:\t42\n"));
        assert!(ours.in_fdinfo("link_type:\ttcx\nlink_id:\t7\nprog_tag:\tab\n"));
        assert!(!ours.in_fdinfo("map_type:\t1\nmap_id:\t7\n"), "a map with a link's ID is not ours");
        assert!(!ours.in_fdinfo("link_id:\t8\n"));
    }

    #[test]
    fn tc_pin_names() {
        assert!(matches!(tc_hook("ingress-7"), Some((7, TcAttachType::Ingress))));
        assert!(matches!(tc_hook("egress-12"), Some((12, TcAttachType::Egress))));
        assert!(tc_hook("xdp-3").is_none());
        assert!(tc_hook("ingress-x").is_none());
    }
}
