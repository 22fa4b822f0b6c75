//! The socket hooks (connect, sendmsg, recvmsg, getpeername) that translate
//! services for processes on the node itself, attached to `--cgroup-root`
//! (default: the cgroup v2 root) as links pinned next to the TC ones, so
//! they outlive the agent and a restart swaps its programs in atomically.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{
        CgroupAttachMode, CgroupSockAddr,
        cgroup_sock_addr::CgroupSockAddrLink,
        links::{FdLink, PinnedLink},
    },
};
use tracing::{info, warn};

use crate::maps::links_dir;

/// Program names in the object; the link pins are `cgroup-<name>`.
pub const SOCK_PROGRAMS: [&str; 8] = [
    "sock_connect4",
    "sock_sendmsg4",
    "sock_recvmsg4",
    "sock_getpeername4",
    "sock_connect6",
    "sock_sendmsg6",
    "sock_recvmsg6",
    "sock_getpeername6",
];

const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// `--cgroup-root`, or the cgroup v2 root: /sys/fs/cgroup on a unified
/// hierarchy, /sys/fs/cgroup/unified on a hybrid one.
pub fn resolve_root(flag: Option<&Path>) -> Result<PathBuf> {
    let candidates: Vec<PathBuf> = match flag {
        Some(p) => vec![p.to_path_buf()],
        None => vec!["/sys/fs/cgroup".into(), "/sys/fs/cgroup/unified".into()],
    };
    for c in &candidates {
        if nix::sys::statfs::statfs(c).is_ok_and(|st| st.filesystem_type().0 as i64 == CGROUP2_SUPER_MAGIC) {
            return Ok(c.clone());
        }
    }
    anyhow::bail!(
        "--cgroup-root: {} is not a cgroup v2 directory (mount one, e.g. `mount -t cgroup2 none /sys/fs/cgroup`, or pass --cgroup-root)",
        candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(" or ")
    )
}

/// Loads the socket hooks (through the verifier), all before any is
/// attached: a kernel that refuses one gets none.
pub fn load(ebpf: &mut Ebpf) -> Result<()> {
    for name in SOCK_PROGRAMS {
        program(ebpf, name)?.load().map_err(|e| crate::kernel::rejected(name, &e))?;
    }
    Ok(())
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut CgroupSockAddr> {
    Ok(ebpf.program_mut(name).with_context(|| format!("{name} missing from the BPF object"))?.try_into()?)
}

/// Attaches the loaded socket hooks, adopting links a previous agent pinned.
pub fn attach(ebpf: &mut Ebpf, bpffs_root: &Path, cgroup_root: &Path) -> Result<()> {
    let cgroup = std::fs::File::open(cgroup_root).with_context(|| format!("--cgroup-root {}", cgroup_root.display()))?;
    let links = links_dir(bpffs_root);
    std::fs::create_dir_all(&links)?;
    for name in SOCK_PROGRAMS {
        let prog = program(ebpf, name)?;
        let pin = links.join(format!("cgroup-{name}"));
        let adopted = PinnedLink::from_pin(&pin)
            .ok()
            .and_then(|p| CgroupSockAddrLink::try_from(FdLink::from(p)).ok())
            .is_some_and(|link| prog.attach_to_link(link).is_ok());
        if !adopted {
            let _ = std::fs::remove_file(&pin);
            // A link (kernel >= 5.7) always coexists with other programs on the cgroup.
            let id = prog.attach(&cgroup, CgroupAttachMode::Single).with_context(|| format!("attach {name} to {}", cgroup_root.display()))?;
            let link: FdLink = prog.take_link(id)?.try_into()?;
            link.pin(&pin).with_context(|| format!("pin link at {}", pin.display()))?;
        }
        info!(program = name, cgroup = %cgroup_root.display(), adopted, "socket hook attached");
    }
    Ok(())
}

/// As `resolve_root`, but a node without cgroup v2 still gets the TC
/// datapath (None), unless `--cgroup-root` named a directory.
pub fn resolve_root_or_warn(flag: Option<&Path>) -> Result<Option<PathBuf>> {
    match resolve_root(flag) {
        Ok(root) => Ok(Some(root)),
        Err(e) if flag.is_none() => {
            warn!("{e:#}; services are not translated for processes on the node itself");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
