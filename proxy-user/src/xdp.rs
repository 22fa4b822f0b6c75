//! `--xdp-devices`: xdp_ingress on the external interfaces, in front of
//! the TC programs (which stay attached there: XDP leaves them what it
//! cannot finish, and hands them the marks of what it translated).
//!
//! Held like the TCX links: a bpf_link per interface (Linux 5.9+, so every
//! supported kernel), pinned under `<bpffs-root>/links` as `xdp-<ifindex>`,
//! so the program outlives the agent and a restart swaps it in atomically.

use std::path::Path;

use anyhow::{Context, Result};
use aya::{
    Ebpf,
    programs::{
        Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
    },
};
use tracing::debug;

use crate::{cli::XdpAttachMode, maps::XDP_INGRESS};

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

/// Through the verifier (before anything is attached, as the TC programs).
pub fn load(ebpf: &mut Ebpf) -> Result<()> {
    let prog = program(ebpf)?;
    let started = std::time::Instant::now();
    prog.load().map_err(|e| crate::kernel::rejected(XDP_INGRESS, &e))?;
    debug!(program = XDP_INGRESS, ms = started.elapsed().as_millis() as u64, "program loaded");
    Ok(())
}

fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp> {
    let prog = ebpf.program_mut(XDP_INGRESS).with_context(|| format!("{XDP_INGRESS} missing from the BPF object"))?;
    Ok(prog.try_into()?)
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
    let prog = program(ebpf)?;
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
