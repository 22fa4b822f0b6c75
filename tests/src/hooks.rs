//! What runs at an interface's TC hooks, whichever way the agent attached:
//! TCX links (Linux 6.6+), or cls_bpf filters in a clsact qdisc over netlink
//! (older kernels, or `--tc-attach netlink`). Tests ask these questions
//! instead of querying one mechanism, so the same suite checks both.

use std::path::Path;

use anyhow::{Context, Result};
use aya::programs::{
    SchedClassifier, TcAttachType,
    links::{FdLink, PinnedLink},
};
use proxy_user::attach::{NETLINK_HANDLE, NETLINK_PRIORITY};

use crate::netns::Netns;

/// `ingress` / `egress`, as the agent names its pins and `tc` its hooks.
fn hook_name(attach_type: TcAttachType) -> &'static str {
    match attach_type {
        TcAttachType::Ingress => "ingress",
        TcAttachType::Egress => "egress",
    }
}

/// The IDs of every BPF program at the hook: TCX programs, then filters.
pub fn programs(node: &Netns, ifname: &str, attach_type: TcAttachType) -> Result<Vec<u32>> {
    let mut ids = tcx_programs(node, ifname, attach_type)?;
    ids.extend(filters(node, ifname, attach_type)?.into_iter().map(|f| f.program));
    Ok(ids)
}

/// Whether any program runs at ingress of `ifname`.
pub fn attached(node: &Netns, ifname: &str, attach_type: TcAttachType) -> Result<bool> {
    Ok(!programs(node, ifname, attach_type)?.is_empty())
}

fn tcx_programs(node: &Netns, ifname: &str, attach_type: TcAttachType) -> Result<Vec<u32>> {
    let name = std::ffi::CString::new(ifname)?;
    node.run(move || match SchedClassifier::query_tcx(name.as_c_str(), attach_type) {
        Ok((_, progs)) => progs.iter().map(|p| p.id()).collect(),
        // A kernel without TCX has nothing there.
        Err(_) => Vec::new(),
    })
}

/// One cls_bpf filter, as `tc filter show` lists it.
struct Filter {
    ours: bool,
    program: u32,
}

fn filters(node: &Netns, ifname: &str, attach_type: TcAttachType) -> Result<Vec<Filter>> {
    let out = node.command("tc").args(["filter", "show", "dev", ifname, hook_name(attach_type)]).output()?;
    anyhow::ensure!(out.status.success(), "tc filter show dev {ifname}: {}", String::from_utf8_lossy(&out.stderr));
    // "filter protocol all pref 1000 bpf chain 0 handle 0xeb tc_ingress direct-action not_in_hw id 45 tag ..."
    let ours = (format!("pref {NETLINK_PRIORITY} "), format!("handle {NETLINK_HANDLE:#x} "));
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "id")?;
            let program = words.next()?.parse().ok()?;
            Some(Filter { ours: l.contains(&ours.0) && l.contains(&ours.1), program })
        })
        .collect())
}

/// Our attachment at one hook: what holds the program (a TCX link's ID, or
/// the filter's fixed place), and the ID of the program it runs.
pub fn ours(node: &Netns, root: &Path, ifname: &str, attach_type: TcAttachType) -> Result<(String, u32)> {
    let ifindex = {
        let name = std::ffi::CString::new(ifname)?;
        node.run(move || nix::net::if_::if_nametoindex(name.as_c_str()))??
    };
    let pin = root.join("links").join(format!("{}-{ifindex}", hook_name(attach_type)));
    if pin.exists() {
        let info = FdLink::from(PinnedLink::from_pin(&pin).with_context(|| format!("{}", pin.display()))?).info()?;
        return Ok((format!("TCX link {}", info.id()), info.program_id()));
    }
    let filter = filters(node, ifname, attach_type)?
        .into_iter()
        .find(|f| f.ours)
        .with_context(|| format!("neither a TCX link pinned at {} nor our filter on {ifname}", pin.display()))?;
    Ok((format!("filter pref {NETLINK_PRIORITY} handle {NETLINK_HANDLE:#x}"), filter.program))
}
