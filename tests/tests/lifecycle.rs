//! The agent's lifecycle as the interface promises it: SIGTERM leaves the
//! dataplane serving, a restarted agent adopts the pinned maps with the same
//! IDs and conntrack, and `ebpf-proxy cleanup` removes every program link and
//! pin of ours, after which the ClusterIP is no longer translated.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{net::{Ipv4Addr, SocketAddr}, time::Duration};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, agent_bin, dump_json, tc_attached, tc_attached_egress},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request, udp_request},
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_service},
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const TIMEOUT: Duration = Duration::from_secs(10);

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn sigterm_keeps_serving_restart_adopts_and_cleanup_removes_everything() -> Result<()> {
    let mut node = Node::new("life")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let backend = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    // Joins while the agent is down. Its address sorts first, so an agent that
    // handed out IDs afresh would give it backend-1's IDs.
    let newcomer = node.add_pod("backend-0", Ipv4Addr::new(10, 244, 0, 10))?;
    let mut servers = Vec::new();
    for pod in [&backend, &newcomer] {
        servers.push(EchoServer::start(&pod.ns, &pod.name, TCP_TARGET)?);
        servers.push(EchoServer::start(&pod.ns, &pod.name, UDP_TARGET)?);
    }
    let tcp_vip = SocketAddr::from((CLUSTER_IP, TCP_PORT));
    let udp_vip = SocketAddr::from((CLUSTER_IP, UDP_PORT));

    let bpffs = Bpffs::new("life")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[backend.ip]))?;
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    tcp_request(&client.ns, tcp_vip).with_context(|| agent.logs())?;
    let backends_before = dump_json("backends", &root)?;
    assert_eq!(backends_before.as_array().map_or(0, Vec::len), 2, "{backends_before}");
    let conntrack_before = dump_json("conntrack", &root)?.as_array().map_or(0, Vec::len);
    assert!(conntrack_before >= 2, "a flow has two conntrack entries");

    // SIGTERM: a clean exit, and the dataplane keeps translating without an agent.
    let status = agent.stop()?;
    assert!(status.success(), "agent exit status {status}");
    let r = tcp_request(&client.ns, tcp_vip).context("TCP with the agent stopped")?;
    assert_eq!((r.backend.as_str(), r.from), ("backend-1", tcp_vip));
    udp_request(&client.ns, udp_vip).context("UDP with the agent stopped")?;

    // A new agent adopts: same IDs, conntrack kept, still serving, and the
    // backend that joined meanwhile gets a fresh ID.
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[newcomer.ip, backend.ip]))?;
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let backends_after = dump_json("backends", &root)?;
    let id_of = |rows: &serde_json::Value, addr: String| {
        rows.as_array().into_iter().flatten().find(|r| r["address"] == addr.as_str()).map(|r| r["id"].clone())
    };
    for port in [TCP_TARGET, UDP_TARGET] {
        let addr = format!("{}:{port}", backend.ip);
        assert_eq!(id_of(&backends_after, addr.clone()), id_of(&backends_before, addr.clone()), "ID of {addr} after a restart");
    }
    assert_eq!(backends_after.as_array().map_or(0, Vec::len), 4, "{backends_after}");
    let conntrack_after = dump_json("conntrack", &root)?.as_array().map_or(0, Vec::len);
    assert!(conntrack_after >= conntrack_before, "conntrack is not flushed by a restart");
    assert!(agent.logs().contains("adopted=true"), "links adopted:\n{}", agent.logs());
    tcp_request(&client.ns, tcp_vip).with_context(|| agent.logs())?;
    let _ = agent.stop()?;

    // cleanup, on the node as an operator runs it: nothing of ours is left,
    // and the ClusterIP is dead again.
    let out = node.ns.command(agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    assert!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!root.exists(), "{} still exists", root.display());
    for ifname in [&client.host_if, &backend.host_if, &newcomer.host_if] {
        assert!(!tc_attached(&node.ns, ifname)?, "a TC program is still attached to {ifname}");
        assert!(!tc_attached_egress(&node.ns, ifname)?, "a TC program is still attached to {ifname} egress");
    }
    assert!(tcp_request(&client.ns, tcp_vip).is_err(), "the ClusterIP still answers after cleanup");
    Ok(())
}
