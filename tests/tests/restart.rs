//! Restart and upgrade under load: a long-lived TCP stream and a steady UDP
//! flow through a ClusterIP (from a pod) and through a NodePort (from a
//! client outside the node, masqueraded) keep going — no reset, no lost datagram — while
//! the agent is killed with SIGKILL and started again, and while it is
//! replaced by another build of the binary. Each time the TC link on the
//! interface stays the same kernel object and only its program changes
//! (an atomic link update, never a detach and re-attach). An upgrade across
//! a change of map layout is refused with the way out, pins left alone.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result};
use aya::programs::TcAttachType;
use proxy_tests::{
    agent::{Agent, agent_bin},
    bpffs::Bpffs,
    flows::{RawEcho, SteadyFlows},
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_node_port_service},
    netns::Netns,
    topology::{Node, Pod},
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;

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

/// For each hook of `pod`'s interface (ingress, egress): what holds our
/// program (a pinned TCX link, or our netlink filter), the ID of the program
/// in it, and the programs the kernel runs at that hook.
fn hooks(node: &Netns, root: &Path, pod: &Pod) -> Result<Vec<(String, u32, Vec<u32>)>> {
    let mut out = Vec::new();
    for attach_type in [TcAttachType::Ingress, TcAttachType::Egress] {
        let (holder, program) = proxy_tests::hooks::ours(node, root, &pod.host_if, attach_type)?;
        out.push((holder, program, proxy_tests::hooks::programs(node, &pod.host_if, attach_type)?));
    }
    Ok(out)
}

/// The links (or filters) are the ones of `before`, each now running a
/// program other than before, and the only program at its hook.
fn swapped_in_place(before: &[(String, u32, Vec<u32>)], after: &[(String, u32, Vec<u32>)]) -> Result<()> {
    for ((link, prog, _), (link_now, prog_now, running)) in before.iter().zip(after) {
        anyhow::ensure!(link_now == link, "{link} was replaced by {link_now}: detached and re-attached");
        anyhow::ensure!(prog_now != prog, "{link} still runs the old program {prog}");
        anyhow::ensure!(running == &[*prog_now], "programs at the hook: {running:?}, expected only {prog_now}");
    }
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn flows_survive_sigkill_restart_and_upgrade() -> Result<()> {
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
    std::fs::write(manifests.path().join("echo.yaml"), echo_node_port_service(CLUSTER_IP, &[b1.ip, b2.ip], TCP_NODE_PORT, UDP_NODE_PORT))?;

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

/// An upgrade across a change of map layout cannot reuse the pinned maps:
/// the new agent must refuse at once, naming the map, the two layouts and
/// the way out, and leave the pins as they were (they still serve the old
/// build's connections).
#[test]
#[ignore = "needs root (bpffs and BPF)"]
fn a_pinned_map_of_another_layout_is_refused_with_the_way_out() -> Result<()> {
    use proxy_common::{MAP_CONNTRACK, MAP_SNAT_ADDRS};

    let bpffs = Bpffs::new("layout")?;
    let root = bpffs.path().join("agent");
    // This build's pins, then another map under CONNTRACK's name, as an
    // older build with another conntrack entry would have left it.
    drop(proxy_user::maps::load(&root)?);
    std::fs::remove_file(root.join(MAP_CONNTRACK))?;
    std::fs::rename(root.join(MAP_SNAT_ADDRS), root.join(MAP_CONNTRACK))?;

    let node = Netns::new(&format!("layout-{}", proxy_tests::unique_suffix()))?;
    let manifests = tempfile::tempdir()?;
    let mut agent = node
        .command(agent_bin().to_str().context("agent path is not UTF-8")?)
        .arg("run")
        .arg("--manifests")
        .arg(manifests.path())
        .arg("--bpffs-root")
        .arg(&root)
        .arg("--node-name")
        .arg("layout")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let deadline = std::time::Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = agent.try_wait()? {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = agent.kill();
            let _ = agent.wait();
            anyhow::bail!("the agent started on maps of another layout instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut agent.stderr.take().context("agent stderr")?, &mut stderr)?;
    assert!(!status.success(), "exit status {status}; stderr:\n{stderr}");
    let expected = [
        format!("the maps pinned under {} come from an ebpf-proxy build with another map layout ({MAP_CONNTRACK}:", root.display()),
        format!("`ebpf-proxy cleanup --bpffs-root {}`", root.display()),
    ];
    for text in &expected {
        assert!(stderr.contains(text.as_str()), "stderr lacks {text:?}:\n{stderr}");
    }
    assert!(root.join(MAP_CONNTRACK).exists(), "the mismatched pin was removed");
    Ok(())
}
