//! `--xdp-devices`: xdp_ingress on the external interfaces, in front of
//! the TC programs (which stay attached there: XDP leaves them what it
//! cannot finish, and hands them the marks of what it translated).
//!
//! Held like the TCX links: a bpf_link per interface (Linux 5.9+, so every
//! supported kernel), pinned under `<bpffs-root>/links` as `xdp-<ifindex>`,
//! so the program outlives the agent and a restart swaps it in atomically.
//!
//! xdp_ingress hands the frames it translated to `xdp_send_out` (in the
//! pinned XDP_PROGRAMS), which sends them out of any interface in
//! XDP_DEVICES itself; the agent lists each interface there as XDP
//! attaches, and takes it out as XDP leaves it.

use std::path::Path;

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    maps::{MapData, PerCpuHashMap, PerCpuValues, ProgramArray},
    programs::{
        Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use tracing::debug;

use proxy_common::{MAP_XDP_DEVICES, MAP_XDP_PROGRAMS, XDP_PROG_SEND_OUT};

use crate::{
    cli::XdpAttachMode,
    maps::{XDP_INGRESS, XDP_SEND_OUT},
};

/// The prefix of the XDP link pins.
pub const PIN_PREFIX: &str = "xdp";

/// What `--xdp-devices` and `--xdp-mode` ask for; None: no XDP.
#[derive(Debug, Clone)]
pub struct XdpSettings {
    pub devices: Vec<String>,
    pub mode: XdpAttachMode,
}

impl XdpSettings {
    /// XDP is wanted only with devices named and the mode not `off`. With
    /// `--devices`, each XDP device must be one of them: XDP hands its
    /// translated frames to the TC programs there.
    pub fn from_flags(xdp_devices: &[String], mode: XdpAttachMode, devices: Option<&[String]>) -> Result<Option<Self>> {
        if xdp_devices.is_empty() || mode == XdpAttachMode::Off {
            return Ok(None);
        }
        if let Some(tc) = devices {
            let missing: Vec<&str> = xdp_devices.iter().filter(|d| !tc.contains(d)).map(String::as_str).collect();
            anyhow::ensure!(
                missing.is_empty(),
                "--xdp-devices {}: not in --devices; XDP needs the TC programs on the same interface (add them to --devices)",
                missing.join(",")
            );
        }
        Ok(Some(XdpSettings { devices: xdp_devices.to_vec(), mode }))
    }

    pub fn wants(&self, name: &str) -> bool {
        self.devices.iter().any(|d| d == name)
    }
}

/// Through the verifier (before anything is attached, as the TC programs):
/// xdp_ingress, and xdp_send_out, installed in its slot of XDP_PROGRAMS.
pub fn load(ebpf: &mut Ebpf) -> Result<()> {
    crate::verifier::verify_all(ebpf, &PROGRAMS)?;
    install(ebpf)
}

/// The XDP programs, for `verifier::verify_all`.
pub const PROGRAMS: [&str; 2] = [XDP_INGRESS, XDP_SEND_OUT];

/// Installs xdp_send_out (verified) in its slot of XDP_PROGRAMS.
pub fn install(ebpf: &mut Ebpf) -> Result<()> {
    let send_out = program(ebpf, XDP_SEND_OUT)?.fd()?.try_clone()?;
    let map = ebpf.map_mut(MAP_XDP_PROGRAMS).with_context(|| format!("map {MAP_XDP_PROGRAMS} missing from the BPF object"))?;
    let mut programs: ProgramArray<&mut MapData> = map.try_into()?;
    programs.set(XDP_PROG_SEND_OUT, &send_out, 0).with_context(|| format!("installing {XDP_SEND_OUT} in {MAP_XDP_PROGRAMS}"))?;
    Ok(())
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut Xdp> {
    let prog = ebpf.program_mut(name).with_context(|| format!("{name} missing from the BPF object"))?;
    Ok(prog.try_into()?)
}

fn devices(ebpf: &mut Ebpf) -> Result<PerCpuHashMap<&mut MapData, u32, u64>> {
    let map = ebpf.map_mut(MAP_XDP_DEVICES).with_context(|| format!("map {MAP_XDP_DEVICES} missing from the BPF object"))?;
    Ok(map.try_into()?)
}

/// Lets XDP send frames out of `ifindex` (keeping the count of an earlier
/// agent's entry).
pub fn allow_sending(ebpf: &mut Ebpf, ifindex: u32) -> Result<()> {
    let mut devices = devices(ebpf)?;
    if devices.get(&ifindex, 0).is_ok() {
        return Ok(());
    }
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?.get() as usize;
    let zeros = PerCpuValues::try_from(vec![0u64; cpus])?;
    devices.insert(&ifindex, zeros, 0).with_context(|| format!("map {MAP_XDP_DEVICES}: add ifindex {ifindex}"))
}

/// Stops XDP sending frames out of interfaces not in `attached` (gone,
/// or no longer in --xdp-devices).
pub fn keep_sending_only(ebpf: &mut Ebpf, attached: &std::collections::BTreeSet<u32>) {
    let Ok(mut devices) = devices(ebpf) else { return };
    let stale: Vec<u32> = devices.keys().filter_map(|k| k.ok()).filter(|i| !attached.contains(i)).collect();
    for ifindex in stale {
        let _ = devices.remove(&ifindex);
    }
}

/// The frames XDP sent out of each interface (ifindex), as pinned under
/// `root` by the running agent.
pub fn sent(root: &Path) -> Result<Vec<(u32, u64)>> {
    let map: PerCpuHashMap<MapData, u32, u64> = crate::maps::open_pin(root, MAP_XDP_DEVICES)?.try_into()?;
    map.iter().map(|entry| {
        let (ifindex, per_cpu) = entry?;
        Ok((ifindex, per_cpu.iter().sum()))
    }).collect()
}

/// How an interface got the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// A previous agent's link, now running this program.
    Adopted,
    /// A new link in this mode.
    New(&'static str),
}

/// Attaches (or adopts the pinned link of) xdp_ingress on an interface.
/// `auto` tries the driver first and falls back to generic XDP, which
/// every device has.
pub fn attach(ebpf: &mut Ebpf, pin: &Path, ifindex: u32, name: &str, mode: XdpAttachMode) -> Result<Attached> {
    let prog = program(ebpf, XDP_INGRESS)?;
    if let Ok(old) = PinnedLink::from_pin(pin) {
        let adopted = XdpLink::try_from(FdLink::from(old))
            .map_err(anyhow::Error::from)
            .and_then(|link| Ok(prog.attach_to_link(link)?));
        match adopted {
            Ok(id) => {
                // The pin holds the link; this process's handle may go.
                let _: FdLink = prog.take_link(id)?.try_into()?;
                return Ok(Attached::Adopted);
            }
            Err(e) => {
                debug!(interface = name, error = %e, "pinned XDP link unusable; replacing it");
                let _ = std::fs::remove_file(pin);
            }
        }
    }
    let tries: &[(XdpMode, &'static str)] = match mode {
        XdpAttachMode::Native => &[(XdpMode::Driver, "native")],
        XdpAttachMode::Generic => &[(XdpMode::Skb, "generic")],
        XdpAttachMode::Auto => &[(XdpMode::Driver, "native"), (XdpMode::Skb, "generic")],
        XdpAttachMode::Off => anyhow::bail!("--xdp-mode off: nothing to attach"),
    };
    let mut last = None;
    for &(xdp_mode, label) in tries {
        match prog.attach(ifindex, xdp_mode) {
            Ok(id) => {
                let link: FdLink = prog.take_link(id)?.try_into().context("XDP attached without a bpf_link (Linux < 5.9)")?;
                link.pin(pin).with_context(|| format!("pin XDP link at {}", pin.display()))?;
                return Ok(Attached::New(label));
            }
            Err(e) => {
                debug!(interface = name, mode = label, error = %e, "XDP attach refused");
                last = Some(anyhow::Error::new(e).context(format!("attach {XDP_INGRESS} to {name} (ifindex {ifindex}) in {label} mode")));
            }
        }
    }
    Err(last.expect("at least one mode tried"))
}
