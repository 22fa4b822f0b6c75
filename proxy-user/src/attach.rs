//! Keeps the TC programs attached at ingress (translation) and egress
//! (masquerade) of every node interface (or the `--devices` ones), including
//! interfaces that appear later, such as the veth of a new pod. Links are TCX
//! links pinned under `<bpffs-root>/links` as `<hook>-<ifindex>`, so they
//! outlive the agent, and a restarted agent swaps its programs into them
//! atomically.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{
        LinkOrder, SchedClassifier, TcAttach, TcAttachType,
        links::{FdLink, PinnedLink},
    },
};
use futures::{StreamExt, TryStreamExt};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{LinkAttribute, LinkLayerType, LinkMessage},
};
use rtnetlink::{MulticastGroup, new_multicast_connection};
use tracing::{debug, info, warn};

use crate::maps::{TC_EGRESS, TC_INGRESS, links_dir};

/// Each program, the hook it runs at, and the prefix of its link pins.
pub const HOOKS: [(&str, TcAttachType, &str); 2] =
    [(TC_INGRESS, TcAttachType::Ingress, "ingress"), (TC_EGRESS, TcAttachType::Egress, "egress")];

pub struct Attacher {
    ebpf: Ebpf,
    links: PathBuf,
    /// Only these interfaces; `None`: every non-loopback interface.
    devices: Option<Vec<String>>,
    attached: BTreeMap<u32, String>,
}

impl Attacher {
    pub fn new(mut ebpf: Ebpf, root: &Path, devices: Option<Vec<String>>) -> Result<Self> {
        for (program, _, _) in HOOKS {
            crate::maps::load_tc(&mut ebpf, program)?;
        }
        let links = links_dir(root);
        std::fs::create_dir_all(&links).with_context(|| format!("create {}", links.display()))?;
        Ok(Attacher { ebpf, links, devices, attached: BTreeMap::new() })
    }

    fn wanted(&self, link: &LinkMessage) -> Option<String> {
        let name = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        })?;
        let wanted = match &self.devices {
            Some(list) => list.contains(&name),
            None => link.header.link_layer_type != LinkLayerType::Loopback,
        };
        wanted.then_some(name)
    }

    fn pin_path(&self, hook: &str, ifindex: u32) -> PathBuf {
        self.links.join(format!("{hook}-{ifindex}"))
    }

    /// Attaches both programs to an interface.
    fn attach(&mut self, ifindex: u32, name: &str) -> Result<()> {
        if self.attached.contains_key(&ifindex) {
            return Ok(());
        }
        for (program, attach_type, hook) in HOOKS {
            let adopted = self.attach_one(program, attach_type, hook, ifindex, name)?;
            info!(interface = %name, ifindex, hook, adopted, "attached");
        }
        self.attached.insert(ifindex, name.to_string());
        Ok(())
    }

    /// Attaches, or atomically replaces the program in a link a previous agent
    /// pinned (true: adopted).
    fn attach_one(&mut self, program: &str, attach_type: TcAttachType, hook: &str, ifindex: u32, name: &str) -> Result<bool> {
        let pin = self.pin_path(hook, ifindex);
        let prog: &mut SchedClassifier = self.ebpf.program_mut(program).unwrap().try_into()?;
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
        if let Some(name) = self.attached.remove(&ifindex) {
            for (_, _, hook) in HOOKS {
                let _ = std::fs::remove_file(self.pin_path(hook, ifindex));
            }
            info!(interface = %name, ifindex, "interface gone");
        }
    }

    /// Pins for interfaces that no longer exist.
    fn remove_stale_pins(&self) {
        let Ok(entries) = std::fs::read_dir(&self.links) else { return };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let ifindex = name.split_once('-').and_then(|(_, i)| i.parse::<u32>().ok());
            if ifindex.is_some_and(|i| !self.attached.contains_key(&i)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }

    fn handle(&mut self, link: &LinkMessage) {
        if let Some(name) = self.wanted(link) {
            if let Err(e) = self.attach(link.header.index, &name) {
                // One interface failing must not stop service on the others.
                warn!(interface = %name, "cannot attach, skipped: {e:#}");
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
