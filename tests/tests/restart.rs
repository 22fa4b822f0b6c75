//! Restart and upgrade under load: a long-lived TCP stream and a steady UDP
//! flow through a ClusterIP (from a pod) and through a NodePort (from a
//! client outside the node, masqueraded) keep going — no reset, no lost datagram — while
//! the agent is killed with SIGKILL and started again, and while it is
//! replaced by another build of the binary. Each time the TC link on the
//! interface stays the same kernel object and only its program changes
//! (an atomic link update, never a detach and re-attach).

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result};
use aya::programs::{
    SchedClassifier, TcAttachType,
    links::{FdLink, PinnedLink},
};
use proxy_tests::{
    agent::{Agent, agent_bin},
    bpffs::Bpffs,
    flows::{RawEcho, SteadyFlows},
    is_root,
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_service},
    netns::Netns,
    topology::{Node, Pod},
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

/// The echo Service as a NodePort, with its EndpointSlice.
fn node_port_service(backends: &[Ipv4Addr]) -> String {
    echo_service("demo", "echo", CLUSTER_IP, backends)
        .replace("type: ClusterIP", "type: NodePort")
        .replace(
            &format!("targetPort: {TCP_TARGET}, protocol: TCP}}"),
            &format!("targetPort: {TCP_TARGET}, nodePort: {TCP_NODE_PORT}, protocol: TCP}}"),
        )
        .replace("targetPort: dns, protocol: UDP}", &format!("targetPort: dns, nodePort: {UDP_NODE_PORT}, protocol: UDP}}"))
}

/// A client outside the node, on a link of its own to the node.
fn external_client(node: &Node) -> Result<Netns> {
    let ext = Netns::new(&format!("{}-ext", node.prefix))?;
    let node_if = format!("{}x", node.prefix);
    node.ns.ip(&["link", "add", &node_if, "type", "veth", "peer", "name", "eth0", "netns", &ext.name])?;
    node.ns.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", &node_if])?;
    node.ns.ip(&["link", "set", &node_if, "up"])?;
    ext.ip(&["addr", "add", &format!("{EXTERNAL_IP}/24"), "dev", "eth0"])?;
    ext.ip(&["link", "set", "eth0", "up"])?;
    Ok(ext)
}
const TIMEOUT: Duration = Duration::from_secs(20);
/// Exchanges each flow must complete in each phase.
const STEP: u64 = 50;

/// For each hook of `pod`'s interface (ingress, egress): the ID of our
/// pinned TCX link, the ID of the program in it, and the programs the kernel
/// runs at that hook.
fn hooks(node: &Netns, root: &Path, pod: &Pod) -> Result<Vec<(u32, u32, Vec<u32>)>> {
    let ifname = std::ffi::CString::new(pod.host_if.clone())?;
    let root = root.to_path_buf();
    node.run(move || -> Result<Vec<(u32, u32, Vec<u32>)>> {
        let ifindex = nix::net::if_::if_nametoindex(ifname.as_c_str())?;
        let mut out = Vec::new();
        for (hook, attach_type) in [("ingress", TcAttachType::Ingress), ("egress", TcAttachType::Egress)] {
            let pin = root.join("links").join(format!("{hook}-{ifindex}"));
            let link = FdLink::from(PinnedLink::from_pin(&pin).with_context(|| format!("{}", pin.display()))?);
            let info = link.info()?;
            let (_, progs) = SchedClassifier::query_tcx(ifname.as_c_str(), attach_type)?;
            out.push((info.id(), info.program_id(), progs.iter().map(|p| p.id()).collect()));
        }
        Ok(out)
    })?
}

/// The links are the ones of `before`, each now running a program other
/// than before, and the only program at its hook.
fn swapped_in_place(before: &[(u32, u32, Vec<u32>)], after: &[(u32, u32, Vec<u32>)]) -> Result<()> {
    for ((link, prog, _), (link_now, prog_now, running)) in before.iter().zip(after) {
        anyhow::ensure!(link_now == link, "link {link} was replaced by link {link_now}: detached and re-attached");
        anyhow::ensure!(prog_now != prog, "link {link} still runs the old program {prog}");
        anyhow::ensure!(running == &[*prog_now], "programs at the hook: {running:?}, expected only {prog_now}");
    }
    Ok(())
}

#[test]
fn flows_survive_sigkill_restart_and_upgrade() -> Result<()> {
    assert!(is_root(), "needs root (network namespaces and BPF)");
    let mut node = Node::new("rst")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    // Two backends: a restart that lost conntrack would move the TCP stream
    // to the other one half the time, and that backend would reset it.
    let b1 = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let b2 = node.add_pod("backend-2", Ipv4Addr::new(10, 244, 0, 12))?;
    let _echo = [RawEcho::start(&b1.ns, TCP_TARGET, UDP_TARGET)?, RawEcho::start(&b2.ns, TCP_TARGET, UDP_TARGET)?];
    let ext = external_client(&node)?;
    let bpffs = Bpffs::new("rst")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), node_port_service(&[b1.ip, b2.ip]))?;

    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let flows = SteadyFlows::start(
        &client.ns,
        SocketAddr::from((CLUSTER_IP, TCP_PORT)),
        SocketAddr::from((CLUSTER_IP, UDP_PORT)),
    )?;
    let p = flows.wait_progress(flows.progress(), STEP).with_context(|| agent.logs())?;
    let np_flows = SteadyFlows::start(
        &ext,
        SocketAddr::from((NODE_IP, TCP_NODE_PORT)),
        SocketAddr::from((NODE_IP, UDP_NODE_PORT)),
    )
    .with_context(|| agent.logs())?;
    let np = np_flows.wait_progress(np_flows.progress(), STEP).with_context(|| agent.logs())?;
    let first = hooks(&node.ns, &root, &client)?;
    for (_, prog, running) in &first {
        assert_eq!(running, &[*prog], "exactly our program runs at each hook");
    }

    // SIGKILL: the dataplane serves on its own while no agent runs.
    let status = agent.kill()?;
    assert!(!status.success(), "killed, not exited: {status}");
    let p = flows.wait_progress(p, STEP).context("flows with no agent running")?;
    let np = np_flows.wait_progress(np, STEP).context("NodePort flows with no agent running")?;

    // Started again: adopts maps and links; the new program is swapped into the same link.
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let p = flows.wait_progress(p, STEP).with_context(|| agent.logs())?;
    let np = np_flows.wait_progress(np, STEP).with_context(|| agent.logs())?;
    let first_sync = agent.logs().lines().find(|l| l.contains("sync done")).map(str::to_string);
    assert!(
        first_sync.as_deref().is_some_and(|l| l.contains("writes=0 deletes=0")),
        "a restart with nothing changed writes nothing: {first_sync:?}"
    );
    let restarted = hooks(&node.ns, &root, &client)?;
    swapped_in_place(&first, &restarted).context("after the restart")?;

    // Upgrade: the old agent is stopped as a DaemonSet rollout stops it, and
    // another build of the binary takes over.
    let upgraded = tempfile::tempdir()?;
    let new_bin = upgraded.path().join("ebpf-proxy-upgraded");
    std::fs::copy(agent_bin(), &new_bin).context("copy the agent binary")?;
    let status = agent.stop()?;
    assert!(status.success(), "SIGTERM exit status {status}");
    let p = flows.wait_progress(p, STEP).context("flows between the old agent and the new")?;
    let np = np_flows.wait_progress(np, STEP).context("NodePort flows between the old agent and the new")?;
    let mut agent = Agent::start_bin(&new_bin, &node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    flows.wait_progress(p, STEP).with_context(|| agent.logs())?;
    np_flows.wait_progress(np, STEP).with_context(|| agent.logs())?;
    let upgraded = hooks(&node.ns, &root, &client)?;
    swapped_in_place(&restarted, &upgraded).context("after the upgrade")?;
    assert!(agent.logs().contains("adopted=true"), "{}", agent.logs());

    for (what, report) in [("ClusterIP", flows.finish()), ("NodePort", np_flows.finish())] {
        assert!(report.errors.is_empty(), "{what}: {:?}", report.errors);
        assert!(
            report.udp_lost.is_empty(),
            "{what}: {} of {} datagrams lost: {:?}",
            report.udp_lost.len(),
            report.udp_sent,
            report.udp_lost
        );
        assert!(report.tcp_round_trips >= 5 * STEP, "{what}: {report:?}");
    }
    Ok(())
}
