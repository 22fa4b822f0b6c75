//! The socket hooks (connect, sendmsg, recvmsg, getpeername) that translate
//! services for processes on the node itself, attached to `--cgroup-root`
//! (default: the cgroup v2 root) as links pinned next to the TC ones, so
//! they outlive the agent and a restart swaps its programs in atomically.

use std::{
    fs::File,
    net::{Ipv4Addr, UdpSocket},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    maps::{Array, MapData},
    programs::{
        CgroupAttachMode, CgroupSockAddr,
        cgroup_sock_addr::CgroupSockAddrLink,
        links::{FdLink, PinnedLink},
    },
};
use proxy_common::{HOST_NETNS_COOKIE, HOST_NETNS_PROBE, MAP_HOST_NETNS};
use tracing::{info, warn};

use crate::maps::links_dir;

/// Program names in the object; the link pins are `cgroup-<name>`. The
/// agent puts them through the verifier with the others, before any is attached.
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

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut CgroupSockAddr> {
    Ok(ebpf.program_mut(name).with_context(|| format!("{name} missing from the BPF object"))?.try_into()?)
}

/// Attaches the loaded socket hooks, adopting links a previous agent pinned,
/// once the hooks know which network namespace is the node's.
pub fn attach(ebpf: &mut Ebpf, bpffs_root: &Path, cgroup_root: &Path) -> Result<()> {
    let cgroup = std::fs::File::open(cgroup_root).with_context(|| format!("--cgroup-root {}", cgroup_root.display()))?;
    let how = store_node_netns(ebpf, &cgroup, cgroup_root)?;
    info!(learned_by = how, "socket hooks translate sockets of this network namespace only (pods are left to TC)");
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

/// How the agent learns its network namespace's cookie: `SO_NETNS_COOKIE`
/// (Linux 5.14+), else `probe` (a socket of its own through connect4).
/// `EBPF_PROXY_NETNS_COOKIE=probe` forces the probe, so newer kernels test
/// the older kernels' path too.
const NETNS_COOKIE_ENV: &str = "EBPF_PROXY_NETNS_COOKIE";

/// Stores the cookie of the agent's network namespace (the node's) in
/// HOST_NETNS, where the hooks compare each socket's against it.
fn store_node_netns(ebpf: &mut Ebpf, cgroup: &File, cgroup_root: &Path) -> Result<&'static str> {
    let probe = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).context("a UDP socket to learn the node's netns cookie")?;
    let forced = std::env::var(NETNS_COOKIE_ENV).is_ok_and(|v| v == "probe");
    if !forced {
        match getsockopt_u64(&probe, libc::SO_NETNS_COOKIE) {
            Ok(netns) => {
                host_netns(ebpf)?.set(HOST_NETNS_COOKIE, &netns, 0)?;
                return Ok("SO_NETNS_COOKIE");
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {}
            Err(e) => return Err(e).context("getsockopt(SO_NETNS_COOKIE)"),
        }
    }
    // Before 5.14: connect4, attached a moment longer on the same cgroup,
    // sees this socket (known by its cookie, which no other socket shares)
    // and stores its namespace's cookie.
    let socket_cookie = getsockopt_u64(&probe, libc::SO_COOKIE).context("getsockopt(SO_COOKIE)")?;
    let mut slots = host_netns(ebpf)?;
    slots.set(HOST_NETNS_COOKIE, &0, 0)?;
    slots.set(HOST_NETNS_PROBE, &socket_cookie, 0)?;
    let connect4 = program(ebpf, SOCK_PROGRAMS[0])?;
    let link = connect4.attach(cgroup, CgroupAttachMode::Single).context("attach connect4 to learn the node's netns")?;
    let connected = probe.connect((Ipv4Addr::LOCALHOST, 9));
    connect4.detach(link)?;
    connected.context("connect the netns probe socket")?;
    let mut slots = host_netns(ebpf)?;
    slots.set(HOST_NETNS_PROBE, &0, 0)?;
    let netns = slots.get(&HOST_NETNS_COOKIE, 0)?;
    anyhow::ensure!(
        netns != 0,
        "could not learn this network namespace's cookie: this kernel has no SO_NETNS_COOKIE (Linux 5.14) and the \
         agent's own socket did not pass the hooks on --cgroup-root {} (run the agent in a cgroup under it)",
        cgroup_root.display()
    );
    Ok("probe")
}

fn host_netns(ebpf: &mut Ebpf) -> Result<Array<&mut MapData, u64>> {
    let map = ebpf.map_mut(MAP_HOST_NETNS).with_context(|| format!("map {MAP_HOST_NETNS} missing from the BPF object"))?;
    Ok(Array::try_from(map)?)
}

/// Whether this kernel tells a socket its network namespace's cookie
/// (SO_NETNS_COOKIE, Linux 5.14); without it the agent probes (see above).
pub fn has_so_netns_cookie() -> bool {
    UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).is_ok_and(|s| getsockopt_u64(&s, libc::SO_NETNS_COOKIE).is_ok())
}

fn getsockopt_u64(socket: &UdpSocket, option: libc::c_int) -> std::io::Result<u64> {
    let mut value = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: value and len are valid for the call and sized for a u64.
    let rc = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, option, (&raw mut value).cast(), &mut len)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(value)
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
