//! Keeps the TC programs attached at ingress (translation) and egress
//! (masquerade) of every node interface (or the `--devices` ones), including
//! interfaces that appear later, such as the veth of a new pod. Loopback
//! gets the egress program only: it is where the node's own packets to its
//! own addresses (a NodePort on the node's IP from a raw socket, or from a
//! process outside --cgroup-root) are met; nothing arrives there from
//! outside.
//!
//! Interfaces get the copy of the programs for their link type: Ethernet
//! (and loopback), or L3 devices without a link-layer header (WireGuard and
//! tun: ARPHRD_NONE; IPIP, SIT, GRE and their IPv6 kinds), loaded the first
//! time one appears (`maps::load_for_l3_devices`). Any other link type is
//! left alone, with a log line saying why.
//!
//! Two ways, one promise: the programs outlive the agent, and a restarted
//! agent swaps its programs in atomically (never a moment with none or two).
//! - TCX (Linux 6.6+, found by probing): links pinned under
//!   `<bpffs-root>/links` as `<hook>-<ifindex>`; a restart updates the link.
//! - Elsewhere, a cls_bpf filter in the interface's clsact qdisc, added over
//!   netlink at a fixed priority and handle (`NETLINK_PRIORITY`,
//!   `NETLINK_HANDLE`); a restart replaces that filter's program in place.
//!   Filters belong to the interface, so nothing is pinned for them.
//!
//! The `--xdp-devices` among them also get xdp_ingress (see crate::xdp),
//! after their TC programs.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttach, TcAttachType,
        links::{FdLink, Link, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcHandle},
    },
};
use futures::{StreamExt, TryStreamExt};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage},
};
use rtnetlink::{MulticastGroup, new_multicast_connection};
use tracing::{debug, info, warn};

use crate::{
    cli::TcAttachMode,
    maps::{self, LinkKind, LoadOptions, TC_EGRESS, TC_INGRESS, links_dir},
    xdp::{self, XdpSettings},
};

/// A TC program, the hook it runs at, and the prefix of its link pins.
pub type Hook = (&'static str, TcAttachType, &'static str);

/// Each program, the hook it runs at, and the prefix of its link pins;
/// egress last (loopback gets only that).
pub const HOOKS: [Hook; 2] =
    [(TC_INGRESS, TcAttachType::Ingress, "ingress"), (TC_EGRESS, TcAttachType::Egress, "egress")];

/// Where our cls_bpf filter sits in each clsact hook (`tc filter show dev
/// IFACE ingress` shows `pref 1000 ... handle 0xeb tc_ingress`): fixed, so
/// the next agent, and `cleanup`, find it.
pub const NETLINK_PRIORITY: u16 = 1000;
pub const NETLINK_HANDLE: u32 = 0xeb;

/// How the TC programs are held on the interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    Tcx,
    Netlink,
}

impl AttachMode {
    pub fn name(self) -> &'static str {
        match self {
            AttachMode::Tcx => "tcx",
            AttachMode::Netlink => "netlink",
        }
    }
}

/// `--tc-attach`, given what the kernel has. Needs `tc_ingress` loaded.
pub fn choose_mode(ebpf: &mut Ebpf, wanted: TcAttachMode) -> Result<AttachMode> {
    let prog: &mut SchedClassifier = ebpf.program_mut(TC_INGRESS).context("tc_ingress missing")?.try_into()?;
    let tcx = has_tcx(prog);
    Ok(match wanted {
        TcAttachMode::Auto if tcx => AttachMode::Tcx,
        TcAttachMode::Auto | TcAttachMode::Netlink => AttachMode::Netlink,
        TcAttachMode::Tcx if tcx => AttachMode::Tcx,
        TcAttachMode::Tcx => anyhow::bail!("--tc-attach tcx: this kernel has no TCX links (Linux 6.6 or a backport); use auto or netlink"),
    })
}

/// Whether the kernel has TCX: it knows the attach type and then looks for
/// the interface, so an index no interface has fails with ENODEV; a kernel
/// without TCX refuses the attach type itself (EINVAL).
fn has_tcx(prog: &mut SchedClassifier) -> bool {
    match prog.attach(u32::MAX, TcAttach::Tcx { attach_type: TcAttachType::Ingress, order: LinkOrder::default() }) {
        Ok(id) => {
            let _ = prog.detach(id);
            true
        }
        Err(ProgramError::SyscallError(e)) => e.io_error.raw_os_error() == Some(libc::ENODEV),
        Err(e) => {
            debug!("TCX probe: {e}");
            false
        }
    }
}

/// The netlink filter of `attach_type` on `ifindex`, as a link aya can
/// replace the program of or detach.
fn netlink_filter(ifindex: u32, attach_type: TcAttachType) -> Result<SchedClassifierLink> {
    Ok(SchedClassifierLink::attached(ifindex, attach_type.into(), NETLINK_PRIORITY, TcHandle::from(NETLINK_HANDLE), None)?)
}

/// Removes our netlink filters from an interface (absent ones are fine);
/// returns how many there were.
pub fn detach_netlink_filters(ifindex: u32) -> usize {
    HOOKS.iter().filter(|(_, attach_type, _)| netlink_filter(ifindex, *attach_type).is_ok_and(|l| l.detach().is_ok())).count()
}

/// A link taken out of aya's bookkeeping, whose drop would detach it: the
/// attachment must outlive the agent.
fn keep_attached(link: SchedClassifierLink) {
    std::mem::forget(link);
}

/// The copy of the programs a link type gets; None: a link type whose
/// packets they cannot read (InfiniBand, CAN, PPP...).
pub fn link_kind(link_type: LinkLayerType) -> Option<LinkKind> {
    match link_type {
        LinkLayerType::Ether | LinkLayerType::Loopback => Some(LinkKind::Ethernet),
        LinkLayerType::None
        | LinkLayerType::Tunnel
        | LinkLayerType::Tunnel6
        | LinkLayerType::Sit
        | LinkLayerType::Ipgre
        | LinkLayerType::Ip6gre
        | LinkLayerType::Rawip => Some(LinkKind::L3),
        _ => None,
    }
}

/// An interface to attach to, and the copy of the programs its link type
/// gets.
struct Interface {
    index: u32,
    name: String,
    kind: LinkKind,
    /// A veth: XDP there may meet a local sender's partial checksums.
    veth: bool,
}

/// The copy of the programs for L3 devices: loaded when the first one
/// appears (most nodes have none, and the verifier's time is the agent's
/// start-up).
enum L3Programs {
    NotLoaded,
    Loaded(Ebpf),
    /// The kernel refused them: L3 devices are skipped, the rest served.
    Refused(String),
}

pub struct Attacher {
    ebpf: Ebpf,
    l3: L3Programs,
    options: LoadOptions,
    mode: AttachMode,
    root: PathBuf,
    links: PathBuf,
    /// Only these interfaces (and loopback's egress); `None`: every
    /// interface.
    devices: Option<Vec<String>>,
    /// `--xdp-devices`, if XDP is on.
    xdp: Option<XdpSettings>,
    attached: BTreeMap<u32, String>,
    /// The interfaces xdp_ingress is on.
    xdp_attached: BTreeSet<u32>,
    /// Interfaces of a link type we leave alone, logged once each.
    unsupported: BTreeSet<u32>,
}

impl Attacher {
    /// `ebpf` with the TC programs verified and their tail calls installed
    /// (`maps::tc_programs`, `maps::install_tail_calls`), as loaded with
    /// `options` (which load the L3 copy if needed). With `xdp`, `ebpf` has
    /// the XDP programs verified and installed too (`xdp::PROGRAMS`, `xdp::install`).
    pub fn new(
        ebpf: Ebpf,
        options: LoadOptions,
        mode: AttachMode,
        devices: Option<Vec<String>>,
        xdp: Option<XdpSettings>,
    ) -> Result<Self> {
        let root = options.root.clone();
        let links = links_dir(&root);
        std::fs::create_dir_all(&links).with_context(|| format!("create {}", links.display()))?;
        Ok(Attacher {
            ebpf,
            l3: L3Programs::NotLoaded,
            options,
            mode,
            root,
            links,
            devices,
            xdp,
            attached: BTreeMap::new(),
            xdp_attached: BTreeSet::new(),
            unsupported: BTreeSet::new(),
        })
    }

    /// The interface and the hooks it gets, if any.
    fn wanted(&mut self, link: &LinkMessage) -> Option<(Interface, &'static [Hook])> {
        let name = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        })?;
        let link_type = link.header.link_layer_type;
        if link_type == LinkLayerType::Loopback {
            return Some((Interface { index: link.header.index, name, kind: LinkKind::Ethernet, veth: false }, &HOOKS[1..]));
        }
        let veth = link.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::LinkInfo(infos) if infos.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))))
        });
        if !self.devices.as_ref().is_none_or(|list| list.contains(&name)) {
            return None;
        }
        let Some(kind) = link_kind(link_type) else {
            if self.unsupported.insert(link.header.index) {
                warn!(
                    interface = %name,
                    ?link_type,
                    "not attached: the programs read Ethernet frames or, on L3 devices (WireGuard, tun, IPIP, GRE), \
                     IP packets; this link type is neither, so its traffic is not translated"
                );
            }
            return None;
        };
        Some((Interface { index: link.header.index, name, kind, veth }, &HOOKS[..]))
    }

    /// The loaded programs for `kind`, loading the L3 copy the first time.
    fn programs(&mut self, kind: LinkKind) -> Result<&mut Ebpf> {
        if kind == LinkKind::Ethernet {
            return Ok(&mut self.ebpf);
        }
        if matches!(self.l3, L3Programs::NotLoaded) {
            self.l3 = match maps::load_for_l3_devices(&self.options) {
                Ok(ebpf) => {
                    info!("TC programs loaded for L3 devices");
                    L3Programs::Loaded(ebpf)
                }
                Err(e) => L3Programs::Refused(format!("{e:#}")),
            };
        }
        match &mut self.l3 {
            L3Programs::Loaded(ebpf) => Ok(ebpf),
            L3Programs::Refused(why) => anyhow::bail!("the TC programs for L3 devices did not load: {why}"),
            L3Programs::NotLoaded => unreachable!("loaded above"),
        }
    }

    fn program(&mut self, kind: LinkKind, program: &str) -> Result<&mut SchedClassifier> {
        let ebpf = self.programs(kind)?;
        let prog = ebpf.program_mut(program).with_context(|| format!("TC program {program} missing"))?;
        Ok(prog.try_into()?)
    }

    fn pin_path(&self, hook: &str, ifindex: u32) -> PathBuf {
        self.links.join(format!("{hook}-{ifindex}"))
    }

    /// Attaches the programs of `hooks` (their copy for the interface's
    /// link kind) to an interface.
    fn attach(&mut self, iface: &Interface, hooks: &[Hook]) -> Result<()> {
        if self.attached.contains_key(&iface.index) {
            return Ok(());
        }
        for &hook in hooks {
            let adopted = self.attach_one(iface, hook)?;
            info!(
                interface = %iface.name, ifindex = iface.index, hook = hook.2, adopted, mode = self.mode.name(),
                link = iface.kind.name(), "attached"
            );
        }
        self.attached.insert(iface.index, iface.name.clone());
        if self.xdp.as_ref().is_some_and(|x| x.wants(&iface.name)) {
            self.attach_xdp(iface)?;
        }
        Ok(())
    }

    /// xdp_ingress, in front of the TC programs just attached. Only on
    /// Ethernet: it reads Ethernet frames.
    fn attach_xdp(&mut self, iface: &Interface) -> Result<()> {
        let Some(settings) = &self.xdp else { return Ok(()) };
        if iface.kind != LinkKind::Ethernet {
            warn!(interface = %iface.name, "--xdp-devices: not an Ethernet device, XDP not attached (its TC programs serve it)");
            return Ok(());
        }
        if iface.veth {
            warn!(
                interface = %iface.name,
                "--xdp-devices: a veth; XDP updates checksums as whole ones, which frames from a wire carry, but a \
                 container behind this veth sends partial ones (checksum offload) that XDP would corrupt: put XDP on the \
                 node's external NICs"
            );
        }
        let pin = self.pin_path(xdp::PIN_PREFIX, iface.index);
        let how = xdp::attach(&mut self.ebpf, &pin, iface.index, &iface.name, settings.mode)?;
        let (adopted, mode) = match how {
            xdp::Attached::Adopted => (true, "as before"),
            xdp::Attached::New(mode) => (false, mode),
        };
        info!(interface = %iface.name, ifindex = iface.index, hook = "xdp", adopted, mode, "attached");
        self.xdp_attached.insert(iface.index);
        if let Err(e) = xdp::allow_sending(&mut self.ebpf, iface.index) {
            warn!(interface = %iface.name, error = %format!("{e:#}"), "XDP will not send frames out of it (the stack will)");
        }
        Ok(())
    }

    /// Attaches, or atomically replaces the program a previous agent left
    /// (true: adopted). What a previous agent in the other mode left goes
    /// once ours runs (for a moment both run: the second sees translated
    /// packets, which match no frontend, and passes them).
    fn attach_one(&mut self, iface: &Interface, hook: Hook) -> Result<bool> {
        let (_, attach_type, pin_prefix) = hook;
        match self.mode {
            AttachMode::Tcx => {
                let adopted = self.attach_tcx(iface, hook)?;
                if let Ok(link) = netlink_filter(iface.index, attach_type) {
                    let _ = link.detach();
                }
                Ok(adopted)
            }
            AttachMode::Netlink => {
                let adopted = self.attach_netlink(iface, hook)?;
                let _ = std::fs::remove_file(self.pin_path(pin_prefix, iface.index));
                Ok(adopted)
            }
        }
    }

    fn attach_netlink(&mut self, iface: &Interface, (program, attach_type, _): Hook) -> Result<bool> {
        let Interface { index: ifindex, name, kind, .. } = iface;
        // Loaded first: a copy the kernel refuses leaves no qdisc behind.
        self.program(*kind, program)?;
        // The clsact qdisc may hold others' filters too: one we add is
        // recorded, so `cleanup` removes it (only if nobody else uses it).
        match tc::qdisc_add_clsact(*ifindex) {
            Ok(()) => crate::clsact::record_added(&self.root, *ifindex)?,
            Err(tc::TcError::NetlinkError(n)) if n.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(anyhow::Error::new(e).context(format!("add the clsact qdisc to {name} (ifindex {ifindex})"))),
        }
        let prog = self.program(*kind, program)?;
        // Our filter from a previous agent: the program is replaced in place.
        let adopted = match netlink_filter(*ifindex, attach_type).and_then(|l| Ok(prog.attach_to_link(l)?)) {
            Ok(id) => {
                keep_attached(prog.take_link(id)?);
                true
            }
            Err(e) => {
                debug!(%name, ?attach_type, error = %e, "no filter of ours to replace");
                false
            }
        };
        if !adopted {
            let options = NlOptions { priority: NETLINK_PRIORITY, handle: TcHandle::from(NETLINK_HANDLE), classid: None };
            let id = prog
                .attach(*ifindex, TcAttach::Netlink { parent: attach_type.into(), options })
                .with_context(|| format!("attach {program} to {name} (ifindex {ifindex}) over netlink"))?;
            keep_attached(prog.take_link(id)?);
        }
        Ok(adopted)
    }

    fn attach_tcx(&mut self, iface: &Interface, (program, attach_type, hook): Hook) -> Result<bool> {
        let Interface { index: ifindex, name, kind, .. } = iface;
        let ifindex = *ifindex;
        let pin = self.pin_path(hook, ifindex);
        let prog = self.program(*kind, program)?;
        let adopted = match PinnedLink::from_pin(&pin) {
            Ok(old) => match FdLink::from(old).try_into().map_err(anyhow::Error::from).and_then(|l| Ok(prog.attach_to_link(l)?)) {
                Ok(_) => true,
                Err(e) => {
                    // A link left from an interface that is gone: start afresh.
                    debug!(%name, hook, error = %e, "pinned link unusable; replacing it");
                    let _ = std::fs::remove_file(&pin);
                    false
                }
            },
            Err(_) => false,
        };
        if !adopted {
            let id = prog
                .attach(ifindex, TcAttach::Tcx { attach_type, order: LinkOrder::default() })
                .with_context(|| format!("attach {hook} to {name} (ifindex {ifindex})"))?;
            let link: FdLink = prog.take_link(id)?.try_into()?;
            link.pin(&pin).with_context(|| format!("pin link at {}", pin.display()))?;
        }
        Ok(adopted)
    }

    /// The kernel detached the link with the interface; drop our pin.
    fn forget(&mut self, ifindex: u32) {
        crate::clsact::forget(&self.root, ifindex);
        self.unsupported.remove(&ifindex);
        if self.xdp_attached.remove(&ifindex) {
            xdp::keep_sending_only(&mut self.ebpf, &self.xdp_attached);
        }
        if let Some(name) = self.attached.remove(&ifindex) {
            for hook in HOOKS.iter().map(|(_, _, hook)| *hook).chain([xdp::PIN_PREFIX]) {
                let _ = std::fs::remove_file(self.pin_path(hook, ifindex));
            }
            info!(interface = %name, ifindex, "interface gone");
        }
    }

    /// Pins for interfaces that no longer exist, and XDP links of
    /// interfaces no longer in --xdp-devices (unpinned, the kernel detaches
    /// them).
    fn remove_stale_pins(&mut self) {
        xdp::keep_sending_only(&mut self.ebpf, &self.xdp_attached);
        let Ok(entries) = std::fs::read_dir(&self.links) else { return };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some((hook, ifindex)) = name.split_once('-').and_then(|(h, i)| Some((h, i.parse::<u32>().ok()?))) else {
                continue;
            };
            let kept = if hook == xdp::PIN_PREFIX { &self.xdp_attached.contains(&ifindex) } else { &self.attached.contains_key(&ifindex) };
            if !kept {
                if hook == xdp::PIN_PREFIX {
                    info!(ifindex, "XDP detached: the interface is not in --xdp-devices");
                }
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    fn handle(&mut self, link: &LinkMessage) {
        if let Some((iface, hooks)) = self.wanted(link) {
            if let Err(e) = self.attach(&iface, hooks) {
                // One interface failing must not stop service on the others.
                warn!(interface = %iface.name, "cannot attach, skipped: {e:#}");
            }
        }
    }

    /// Attaches to every present interface, then follows link events forever.
    pub async fn run(mut self, ready: tokio::sync::oneshot::Sender<()>) -> Result<()> {
        // Subscribe before listing, so no interface can slip between the two.
        let (conn, handle, mut events) =
            new_multicast_connection(&[MulticastGroup::Link]).context("netlink socket for link events")?;
        tokio::spawn(conn);
        let present: Vec<LinkMessage> = handle.link().get().execute().try_collect().await.context("list interfaces")?;
        for link in &present {
            self.handle(link);
        }
        self.remove_stale_pins();
        if let Some(devices) = &self.devices {
            for d in devices {
                if !self.attached.values().any(|n| n == d) {
                    warn!(device = %d, "--devices names an interface that does not exist (yet); it will be attached when it appears");
                }
            }
        }
        for d in self.xdp.iter().flat_map(|x| &x.devices) {
            if !self.attached.values().any(|n| n == d) {
                warn!(device = %d, "--xdp-devices names an interface that does not exist (yet); XDP goes on it when it appears");
            }
        }
        let _ = ready.send(());

        while let Some((msg, _)) = events.next().await {
            match msg.payload {
                netlink_packet_core::NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => self.handle(&link),
                netlink_packet_core::NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(link)) => {
                    self.forget(link.header.index)
                }
                _ => {}
            }
        }
        anyhow::bail!("netlink link events stopped")
    }
}
