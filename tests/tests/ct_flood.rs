//! Conntrack under a flood. A node whose conntrack holds 4,096 entries
//! (`--conntrack-min 4096 --conntrack-max-per-core 0`) takes 20,000 SYNs
//! from spoofed sources at a NodePort whose two backends answer them. Live
//! flows through the same NodePort — a busy TCP stream, a steady UDP flow,
//! and TCP connections that sit idle through the flood — lose nothing: the
//! flood's flows never complete a handshake, so they stay in the
//! unconfirmed table and evict only each other. Then more answered flows
//! than the confirmed table holds: its evictions are counted.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use etherparse::PacketBuilder;
use proxy_tests::{
    agent::Agent,
    bpffs::Bpffs,
    flows::{RawEcho, SteadyFlows},
    is_root,
    manifests::{TCP_TARGET, UDP_TARGET, echo_node_port_service},
    netns::Netns,
    topology::Node,
};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

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
fn spoofed_syn_flood_evicts_no_live_flow_and_evictions_are_counted() -> Result<()> {
    assert!(is_root(), "needs root (network namespaces and BPF)");
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
    flood(&ext.ns, SocketAddrV4::new(NODE_IP, TCP_NODE_PORT), FLOOD)?;
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
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let line = format!("idle {i}\n");
    conn.write_all(line.as_bytes())?;
    let mut got = vec![0; line.len()];
    conn.read_exact(&mut got)?;
    ensure!(got == line.as_bytes(), "echo {:?}", String::from_utf8_lossy(&got));
    Ok(())
}

/// `count` TCP SYNs to `to`, each from a random source in 198.18.0.0/15
/// (the benchmarking range: nothing answers there) and port, through a raw
/// socket in `ns`.
fn flood(ns: &Netns, to: SocketAddrV4, count: u32) -> Result<()> {
    ns.run(move || -> Result<()> {
        // IPPROTO_RAW: the frame carries its own IP header.
        let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW)))?;
        let dest = SockAddr::from(to);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut frame = Vec::with_capacity(64);
        for _ in 0..count {
            // xorshift64: reproducible, and plenty for spoofed addresses.
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let [a, b, p0, p1, s0, s1, s2, s3] = seed.to_le_bytes();
            let source = [198, 18 | (a & 1), b, p0];
            frame.clear();
            PacketBuilder::ipv4(source, to.ip().octets(), 64)
                .tcp(u16::from_le_bytes([p1, s0]) | 1024, to.port(), u32::from_le_bytes([s0, s1, s2, s3]), 64240)
                .syn()
                .write(&mut frame, &[])?;
            socket.send_to(&frame, &dest)?;
        }
        Ok(())
    })?
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
