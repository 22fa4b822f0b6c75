//! Conntrack under a flood. A node whose conntrack holds 4,096 entries
//! (`--conntrack-min 4096 --conntrack-max-per-core 0`) takes 20,480 SYNs
//! from spoofed sources at a NodePort whose two backends answer them. Live
//! flows through the same NodePort — a busy TCP stream, a steady UDP flow,
//! and TCP connections that sit idle through the flood — lose nothing: the
//! flood's flows never complete a handshake, so they stay in the
//! unconfirmed table and evict only each other. Then more answered flows
//! than the confirmed table holds: its evictions are counted.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use proxy_tests::{
    agent::Agent,
    bpffs::Bpffs,
    flood::spoofed_syns,
    flows::{RawEcho, SteadyFlows, echo_round_trip},
    manifests::{TCP_TARGET, UDP_TARGET, echo_node_port_service},
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 78, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 78, 2);
const TCP_NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
const CONNTRACK: u32 = 4096;
/// Five tables' worth of spoofed SYNs.
const FLOOD: u32 = 5 * CONNTRACK;
/// Connections that sit idle through the flood. Each one's flow, had the
/// flood evicted it, would be balanced afresh to either backend: the other
/// one resets it, so all of them surviving by luck has odds of 1 in 2^16.
const IDLE: usize = 16;
const TIMEOUT: Duration = Duration::from_secs(20);
const STEP: u64 = 50;

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn spoofed_syn_flood_evicts_no_live_flow_and_evictions_are_counted() -> Result<()> {
    let mut node = Node::new("ctfl")?;
    let b1 = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let b2 = node.add_pod("backend-2", Ipv4Addr::new(10, 244, 0, 12))?;
    let _echo = [RawEcho::start(&b1.ns, TCP_TARGET, UDP_TARGET)?, RawEcho::start(&b2.ns, TCP_TARGET, UDP_TARGET)?];
    let ext = node.add_external("ext", NODE_IP, &[EXTERNAL_IP], &[])?;
    let bpffs = Bpffs::new("ctfl")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    let service = echo_node_port_service(CLUSTER_IP, &[b1.ip, b2.ip], TCP_NODE_PORT, UDP_NODE_PORT);
    std::fs::write(manifests.path().join("echo.yaml"), service)?;
    let size = CONNTRACK.to_string();
    let mut agent =
        Agent::start(&node.ns, manifests.path(), &root, &["--conntrack-min", &size, "--conntrack-max-per-core", "0"])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let tcp_to = SocketAddr::from((NODE_IP, TCP_NODE_PORT));
    let flows = SteadyFlows::start(&ext.ns, tcp_to, SocketAddr::from((NODE_IP, UDP_NODE_PORT)))?;
    let p = flows.wait_progress(flows.progress(), STEP).with_context(|| agent.logs())?;
    let mut idle = Vec::new();
    for _ in 0..IDLE {
        idle.push(ext.ns.run(move || TcpStream::connect(tcp_to))??);
    }
    for (i, conn) in idle.iter_mut().enumerate() {
        round_trip(conn, i).with_context(|| format!("idle connection {i} before the flood"))?;
    }

    let before = agent.scrape(&node.ns)?;
    spoofed_syns(&ext.ns, SocketAddrV4::new(NODE_IP, TCP_NODE_PORT), FLOOD, None)?;
    let after = agent.scrape(&node.ns)?;
    let moved = |series: &str| get(&after, series).unwrap_or(0.0) - get(&before, series).unwrap_or(0.0);
    let new_flows = moved(r#"ebpf_proxy_packets_total{verdict="translated",reason="new_flow"}"#);
    ensure!(new_flows >= f64::from(FLOOD) * 0.9, "the flood reached the datapath: {new_flows} new flows for {FLOOD} SYNs");

    // Every live flow goes on: the busy ones without a loss, the idle ones
    // with their next round trip.
    flows.wait_progress(p, STEP).context("flows after the flood")?;
    for (i, conn) in idle.iter_mut().enumerate() {
        round_trip(conn, i).with_context(|| format!("idle connection {i} after {FLOOD} spoofed SYNs"))?;
    }
    let report = flows.finish();
    ensure!(report.errors.is_empty(), "TCP stream: {:?}", report.errors);
    ensure!(report.udp_lost.is_empty(), "UDP: {} of {} datagrams lost", report.udp_lost.len(), report.udp_sent);
    let evicted = get(&after, "ebpf_proxy_conntrack_confirmed_evictions_total")?;
    ensure!(evicted == 0.0, "{evicted} confirmed entries evicted by the flood");
    let unconfirmed = get(&after, r#"ebpf_proxy_conntrack_entries{state="unconfirmed"}"#)?;
    ensure!(unconfirmed <= f64::from(CONNTRACK / 4), "{unconfirmed} unconfirmed entries, over the table's {}", CONNTRACK / 4);

    // More answered flows than the confirmed table holds: each a UDP
    // exchange from a port of its own, masqueraded (three entries each).
    let udp_to = SocketAddr::from((NODE_IP, UDP_NODE_PORT));
    let answered = ext.ns.run(move || udp_exchanges(udp_to, 2 * CONNTRACK as usize))??;
    ensure!(answered > CONNTRACK as usize, "only {answered} UDP exchanges answered");
    let last = agent.scrape(&node.ns)?;
    let evicted = get(&last, "ebpf_proxy_conntrack_confirmed_evictions_total")?;
    let confirmed = get(&last, r#"ebpf_proxy_conntrack_entries{state="confirmed"}"#)?;
    ensure!(confirmed <= f64::from(CONNTRACK), "{confirmed} confirmed entries in a table of {CONNTRACK}");
    // Each answered flow confirmed two or three entries (a flow whose
    // masquerade had to share a port confirms no SNAT entry of its own).
    ensure!(
        evicted >= (2 * answered) as f64 - f64::from(CONNTRACK),
        "{evicted} evictions counted after {answered} answered flows into a table of {CONNTRACK}"
    );
    agent.stop()?;
    Ok(())
}

fn get(scrape: &std::collections::BTreeMap<String, f64>, series: &str) -> Result<f64> {
    scrape.get(series).copied().with_context(|| format!("no {series} in the scrape"))
}

fn round_trip(conn: &mut TcpStream, i: usize) -> Result<()> {
    echo_round_trip(conn, &format!("idle {i}\n"))
}

/// `count` UDP exchanges with the echo behind `to`, each from a socket of
/// its own; how many were answered.
fn udp_exchanges(to: SocketAddr, count: usize) -> Result<usize> {
    let mut answered = 0;
    for i in 0..count {
        let socket = UdpSocket::bind(("0.0.0.0", 0))?;
        socket.set_read_timeout(Some(Duration::from_millis(500)))?;
        socket.send_to(format!("x{i}").as_bytes(), to)?;
        let mut buf = [0u8; 64];
        if socket.recv_from(&mut buf).is_ok() {
            answered += 1;
        }
    }
    Ok(answered)
}
