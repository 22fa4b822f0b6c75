//! `ebpf-proxy cleanup` refuses while the agent runs; after it stopped
//! (having attached to several veths, by TCX links or netlink filters): no
//! program of ours on any interface, no qdisc of ours, no pinned path, our
//! programs and maps gone from the kernel; what others installed (a clsact
//! qdisc, a directory on the bpffs, even inside our root) stays; a second
//! run is a no-op that says so.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{collections::BTreeSet, net::Ipv4Addr, path::Path, time::Duration};

use anyhow::Result;
use aya::{
    maps::{MapData, MapInfo, loaded_maps},
    programs::{ProgramInfo, TcAttachType, loaded_programs},
};
use proxy_tests::{
    agent::{Agent, agent_bin, wait_until},
    bpf_ids,
    bpffs::Bpffs,
    hooks,
    manifests::echo_service,
    netns::Netns,
};
use proxy_user::{attach::HOOKS, maps::PINNED_MAPS};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// Every interface of the namespace, by name.
fn interfaces(ns: &Netns) -> Result<Vec<String>> {
    let out = ns.ip(&["-o", "link", "show"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap().to_string())
        .collect())
}

/// IDs of the TC programs on `ifname`, ingress and egress.
fn tc_programs(ns: &Netns, ifname: &str) -> Result<Vec<u32>> {
    let mut ids = hooks::programs(ns, ifname, TcAttachType::Ingress)?;
    ids.extend(hooks::programs(ns, ifname, TcAttachType::Egress)?);
    Ok(ids)
}

/// Link pins of TC programs (the others are the socket hooks').
fn tc_link_pins(root: &Path) -> Result<usize> {
    Ok(std::fs::read_dir(root.join("links"))?.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with("cgroup-")).count())
}

fn qdiscs(ns: &Netns, ifname: &str) -> Result<String> {
    let out = ns.command("tc").args(["qdisc", "show", "dev", ifname]).output()?;
    anyhow::ensure!(out.status.success(), "tc qdisc show dev {ifname}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?)
}

/// `ebpf-proxy cleanup` on the node, as an operator runs it: netlink
/// filters belong to the node's interfaces.
fn cleanup(node: &Netns, root: &Path) -> Result<String> {
    let out = node.command(agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(root).output()?;
    anyhow::ensure!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?)
}

/// Processes with a descriptor of one of these programs or maps, as
/// "pid (comm): fdinfo line": /proc/PID/fdinfo names the object's ID.
fn fd_holders(programs: &BTreeSet<u32>, maps: &BTreeSet<u32>) -> Result<Vec<String>> {
    let ours = |line: &str| {
        let id = |key: &str| line.strip_prefix(key).and_then(|v| v.trim().parse::<u32>().ok());
        id("prog_id:").is_some_and(|i| programs.contains(&i)) || id("map_id:").is_some_and(|i| maps.contains(&i))
    };
    let mut holders = Vec::new();
    for proc in std::fs::read_dir("/proc")?.flatten() {
        let Ok(fds) = std::fs::read_dir(proc.path().join("fdinfo")) else { continue };
        for fd in fds.flatten() {
            // A process may exit, or close the descriptor, while we look.
            let Ok(info) = std::fs::read_to_string(fd.path()) else { continue };
            if let Some(line) = info.lines().find(|l| ours(l)) {
                let comm = std::fs::read_to_string(proc.path().join("comm")).unwrap_or_default();
                holders.push(format!("{} ({}): {line}", proc.file_name().to_string_lossy(), comm.trim()));
            }
        }
    }
    Ok(holders)
}

/// Maps by ID, name and type, each with the loaded programs that use it.
fn describe(maps: &[MapInfo]) -> String {
    if maps.is_empty() {
        return "no map of ours left".into();
    }
    let programs: Vec<ProgramInfo> = loaded_programs().filter_map(Result::ok).collect();
    let users = |id: u32| -> Vec<String> {
        programs
            .iter()
            .filter(|p| p.map_ids().ok().flatten().is_some_and(|ids| ids.contains(&id)))
            .map(|p| format!("{} {} ({:?})", p.id(), p.name_as_str().unwrap_or("?"), p.program_type()))
            .collect()
    };
    let each: Vec<String> = maps
        .iter()
        .map(|m| format!("{} {} ({:?}) used by {:?}", m.id(), m.name_as_str().unwrap_or("?"), m.map_type(), users(m.id())))
        .collect();
    format!("[{}]", each.join("; "))
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn cleanup_leaves_nothing_of_ours_and_everything_else() -> Result<()> {
    let mut node = proxy_tests::topology::Node::new("clean")?;
    let pods: Vec<_> = (0..3u8).map(|i| node.add_pod(&format!("p{i}"), Ipv4Addr::new(10, 244, 0, 10 + i))).collect::<Result<_>>()?;
    // Someone else's: a clsact qdisc on one veth and a directory on the bpffs.
    node.ns.command("tc").args(["qdisc", "add", "dev", &pods[0].host_if, "clsact"]).status()?;
    let foreign_qdisc = qdiscs(&node.ns, &pods[0].host_if)?;
    assert!(foreign_qdisc.contains("clsact"), "{foreign_qdisc}");
    let bpffs = Bpffs::new("clean")?;
    let other = bpffs.path().join("other-tool");
    std::fs::create_dir(&other)?;

    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[pods[1].ip, pods[2].ip]))?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, Duration::from_secs(10))?;
    let tcx = agent.tc_attach(&node.ns)? == "tcx";

    // What the agent installed: a program on each hook of every veth, its
    // pinned maps, and with TCX one pinned link per program attached (with
    // netlink filters, none: they belong to the interface).
    let mut programs = BTreeSet::new();
    let mut attached = 0;
    for p in &pods {
        let ids = tc_programs(&node.ns, &p.host_if)?;
        assert_eq!(ids.len(), HOOKS.len(), "our programs on {}: {ids:?}", p.host_if);
        attached += ids.len();
        programs.extend(ids);
    }
    let link_pins = std::fs::read_dir(root.join("links"))?.count();
    let tc_pins = tc_link_pins(&root)?;
    if tcx {
        assert!(tc_pins >= attached, "{tc_pins} TC link pins for {attached} attachments");
    } else {
        assert_eq!(tc_pins, 0, "TC link pins with netlink filters");
    }
    let maps: BTreeSet<u32> = PINNED_MAPS
        .iter()
        .map(|m| Ok(MapData::from_pin(root.join(m))?.info()?.id()))
        .collect::<Result<_>>()?;
    // Every program of ours, also those on no interface (tail-called ones,
    // the socket hooks): each uses our maps.
    let attached_programs = programs.len();
    programs.extend(
        loaded_programs()
            .filter_map(Result::ok)
            .filter(|p| p.map_ids().ok().flatten().is_some_and(|ids| ids.iter().any(|id| maps.contains(id))))
            .map(|p| p.id()),
    );
    assert!(programs.len() > attached_programs + 8, "only {} programs use our maps", programs.len());
    // While the agent runs it holds its links: cleanup refuses and touches nothing.
    let out = node.ns.command(agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "cleanup with the agent running: {err}");
    assert!(err.contains("ebpf-proxy (pid ") && err.contains("stop the agent first (nothing was removed)"), "{err}");
    assert_eq!(std::fs::read_dir(root.join("links"))?.count(), link_pins, "pins after the refused cleanup");
    for p in &pods {
        assert_eq!(tc_programs(&node.ns, &p.host_if)?.len(), HOOKS.len(), "programs on {} after the refused cleanup", p.host_if);
    }
    agent.stop()?;

    let said = cleanup(&node.ns, &root)?;
    let pins = link_pins + PINNED_MAPS.len();
    assert!(said.contains(&format!("removed {pins} pinned objects under {}", root.display())), "{said}");
    assert!(said.contains(&format!("released {link_pins} program links")), "{said}");
    if !tcx {
        // Two filters on every interface but lo, which has egress's alone;
        // a qdisc added to each but the one that had someone else's.
        let interfaces = interfaces(&node.ns)?.len();
        let (filters, qdiscs) = ((interfaces - 1) * HOOKS.len() + 1, interfaces - 1);
        assert!(said.contains(&format!("removed {filters} netlink filters and {qdiscs} clsact qdiscs")), "{said}");
    }

    assert!(!root.exists(), "{} still exists", root.display());
    let all = interfaces(&node.ns)?;
    assert!(all.len() > pods.len() && all.contains(&"lo".to_string()), "interfaces: {all:?}");
    for ifname in all {
        assert_eq!(tc_programs(&node.ns, &ifname)?, Vec::<u32>::new(), "TC programs left on {ifname}");
        let q = qdiscs(&node.ns, &ifname)?;
        if ifname == pods[0].host_if {
            assert_eq!(q, foreign_qdisc, "someone else's clsact qdisc on {ifname} was touched");
        } else {
            assert!(!q.contains("clsact") && !q.contains("ingress"), "a qdisc on {ifname}: {q}");
        }
    }
    assert!(other.is_dir(), "someone else's {} was removed", other.display());
    // With the pins gone nothing holds our programs and maps: no process has
    // a descriptor of one, and the kernel frees them. It does so after an RCU
    // grace period and a workqueue pass, which an idle VM can put off for
    // seconds: the bound is for a leak, not for speed.
    let holders = fd_holders(&programs, &maps)?;
    assert!(holders.is_empty(), "processes still hold our programs or maps: {holders:?}");
    wait_until("our programs and maps freed by the kernel", Duration::from_secs(60), || {
        // By ID alone: opening a map here could itself keep it (bpf_ids.rs).
        let progs_left: Vec<u32> = bpf_ids::program_ids()?.intersection(&programs).copied().collect();
        let maps_left: Vec<u32> = bpf_ids::map_ids()?.intersection(&maps).copied().collect();
        if progs_left.is_empty() && maps_left.is_empty() {
            return Ok(true);
        }
        // An error is kept and shown if time runs out.
        anyhow::bail!("still loaded: programs {progs_left:?}, maps {maps_left:?}")
    })
    .map_err(|e| {
        // What is left, and every program that still uses it.
        let maps_left: Vec<MapInfo> = loaded_maps().filter_map(Result::ok).filter(|m| maps.contains(&m.id())).collect();
        e.context(describe(&maps_left))
    })?;

    // Again: nothing to do, and it says so.
    let said = cleanup(&node.ns, &root)?;
    assert_eq!(said.trim(), format!("nothing to clean: {} does not exist", root.display()));

    // Something that is not ours inside the directory stays, and is named.
    let foreign = root.join("operator-notes");
    std::fs::create_dir_all(&foreign)?;
    let said = cleanup(&node.ns, &root)?;
    assert!(said.contains("nothing of ours") && said.contains("left in place") && said.contains("operator-notes"), "{said}");
    assert!(foreign.is_dir());
    Ok(())
}
