//! Restart and upgrade under load: a long-lived TCP stream and a steady UDP
//! flow through a ClusterIP keep going — no reset, no lost datagram — while
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
const TIMEOUT: Duration = Duration::from_secs(20);
/// Exchanges each flow must complete in each phase.
const STEP: u64 = 50;

/// (link ID, program ID) of our pinned TCX link on `pod`'s interface, and the
/// programs the kernel runs at that interface's ingress.
fn hook(node: &Netns, root: &Path, pod: &Pod) -> Result<(u32, u32, Vec<u32>)> {
    let ifname = std::ffi::CString::new(pod.host_if.clone())?;
    let root = root.to_path_buf();
    node.run(move || -> Result<(u32, u32, Vec<u32>)> {
        let ifindex = nix::net::if_::if_nametoindex(ifname.as_c_str())?;
        let pin = root.join("links").join(format!("ingress-{ifindex}"));
        let link = FdLink::from(PinnedLink::from_pin(&pin).with_context(|| format!("{}", pin.display()))?);
        let info = link.info()?;
        let (_, progs) = SchedClassifier::query_tcx(ifname.as_c_str(), TcAttachType::Ingress)?;
        Ok((info.id(), info.program_id(), progs.iter().map(|p| p.id()).collect()))
    })?
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
    let bpffs = Bpffs::new("rst")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[b1.ip, b2.ip]))?;

    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let flows = SteadyFlows::start(
        &client.ns,
        SocketAddr::from((CLUSTER_IP, TCP_PORT)),
        SocketAddr::from((CLUSTER_IP, UDP_PORT)),
    )?;
    let p = flows.wait_progress(flows.progress(), STEP).with_context(|| agent.logs())?;
    let (link, first_prog, attached) = hook(&node.ns, &root, &client)?;
    assert_eq!(attached, [first_prog], "exactly our program runs at ingress");

    // SIGKILL: the dataplane serves on its own while no agent runs.
    let status = agent.kill()?;
    assert!(!status.success(), "killed, not exited: {status}");
    let p = flows.wait_progress(p, STEP).context("flows with no agent running")?;

    // Started again: adopts maps and links; the new program is swapped into the same link.
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let p = flows.wait_progress(p, STEP).with_context(|| agent.logs())?;
    let (link_after, restarted_prog, attached) = hook(&node.ns, &root, &client)?;
    assert_eq!(link_after, link, "the restart kept the link");
    assert_ne!(restarted_prog, first_prog, "the restarted agent's program is on the hook");
    assert_eq!(attached, [restarted_prog], "one program at ingress, never none and never two");

    // Upgrade: the old agent is stopped as a DaemonSet rollout stops it, and
    // another build of the binary takes over.
    let upgraded = tempfile::tempdir()?;
    let new_bin = upgraded.path().join("ebpf-proxy-upgraded");
    std::fs::copy(agent_bin(), &new_bin).context("copy the agent binary")?;
    let status = agent.stop()?;
    assert!(status.success(), "SIGTERM exit status {status}");
    let p = flows.wait_progress(p, STEP).context("flows between the old agent and the new")?;
    let mut agent = Agent::start_bin(&new_bin, &node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    flows.wait_progress(p, STEP).with_context(|| agent.logs())?;
    let (link_after, upgraded_prog, attached) = hook(&node.ns, &root, &client)?;
    assert_eq!(link_after, link, "the upgrade kept the link");
    assert_ne!(upgraded_prog, restarted_prog, "the upgraded agent's program is on the hook");
    assert_eq!(attached, [upgraded_prog]);
    assert!(agent.logs().contains("adopted=true"), "{}", agent.logs());

    let report = flows.finish();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(report.udp_lost.is_empty(), "{} of {} datagrams lost: {:?}", report.udp_lost.len(), report.udp_sent, report.udp_lost);
    assert!(report.tcp_round_trips >= 6 * STEP, "{report:?}");
    Ok(())
}
