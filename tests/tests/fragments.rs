//! IP fragments with real traffic, in the production topology (pods' own
//! sockets are left to TC, as every external client's packets are):
//! - a pod sends a 4000-byte UDP datagram to a ClusterIP, which its stack
//!   cuts into three fragments (MTU 1500), and the backend's echo of it,
//!   fragmented the same way, comes back whole from the ClusterIP: IPv4 and
//!   IPv6;
//! - an external client sends one to a NodePort (masqueraded) and gets the
//!   fragmented echo back whole, from the node's address and nodePort.
//!
//! Every fragment after the first takes its first's translation (counted
//! in `ebpf_proxy_fragments_total{fragment="later"}`). Without that, the
//! later fragments leave for the ClusterIP itself, the backend never
//! reassembles the datagram, and the client's wait runs out.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    addrs::{BACKEND, BACKEND6, CLIENT, CLIENT6, VIP, VIP6},
    agent::Agent,
    bpffs::Bpffs,
    manifests::one_port_service,
    netns::Netns,
    topology::Node,
};

const TIMEOUT: Duration = Duration::from_secs(10);
const SIZE: usize = 4000;
const TARGET: u16 = 5353;

const NODE_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 78, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 78, 2);
const NODE_PORT: u16 = 30053;

/// A UDP server that sends every datagram back as it came, until dropped.
struct Mirror {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Mirror {
    fn start(ns: &Netns, bind: SocketAddr) -> Result<Mirror> {
        let socket = ns.run(move || UdpSocket::bind(bind))?.with_context(|| format!("udp bind {bind} in {}", ns.name))?;
        socket.set_read_timeout(Some(Duration::from_millis(50)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            while !flag.load(Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(&buf[..n], from);
                }
            }
        });
        Ok(Mirror { stop, thread: Some(thread) })
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One SIZE-byte datagram from `ns` to `to` on a connected socket (which
/// takes only an answer from `to`): the answer must be the same bytes.
fn round_trip(ns: &Netns, to: SocketAddr) -> Result<()> {
    ns.run(move || -> Result<()> {
        let any: IpAddr = if to.is_ipv4() { [0u8; 4].into() } else { [0u16; 8].into() };
        let s = UdpSocket::bind((any, 0))?;
        s.connect(to)?;
        s.set_read_timeout(Some(TIMEOUT))?;
        let sent: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
        s.send(&sent)?;
        let mut got = vec![0u8; 65536];
        let n = s.recv(&mut got).with_context(|| format!("no answer from {to} to a {SIZE}-byte datagram"))?;
        anyhow::ensure!(got[..n] == sent[..], "{to} answered {n} bytes, not the {SIZE} sent");
        Ok(())
    })?
}

fn later_fragments(agent: &Agent, node: &Netns) -> Result<f64> {
    let m = agent.scrape(node)?;
    m.get(r#"ebpf_proxy_fragments_total{fragment="later"}"#).copied().context("no fragments metric")
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_datagram_larger_than_the_mtu_reaches_a_cluster_ip_and_its_fragmented_echo_comes_back() -> Result<()> {
    let mut node = Node::new("frag")?;
    let client = node.add_pod("client", CLIENT)?;
    let client6 = node.add_pod("client6", CLIENT6)?;
    let backend = node.add_pod("backend", BACKEND)?;
    let backend6 = node.add_pod("backend6", BACKEND6)?;
    let _mirror = Mirror::start(&backend.ns, (BACKEND, TARGET).into())?;
    let _mirror6 = Mirror::start(&backend6.ns, (BACKEND6, TARGET).into())?;
    let bpffs = Bpffs::new("frag")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    let manifests = [
        one_port_service("dns", VIP.into(), 53, TARGET, "UDP", BACKEND.into(), None),
        one_port_service("dns6", VIP6.into(), 53, TARGET, "UDP", BACKEND6.into(), None),
    ];
    std::fs::write(dir.path().join("svc.yaml"), manifests.join("---\n"))?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    round_trip(&client.ns, (VIP, 53).into()).context("IPv4 ClusterIP").with_context(|| agent.logs())?;
    // Two later fragments each way: the request's translated at ingress
    // (egress has nothing to do for an unmasqueraded one), the echo's
    // marked at ingress and translated at egress.
    let v4 = later_fragments(&agent, &node.ns)?;
    assert_eq!(v4, 6.0, "later fragments followed (IPv4)");
    round_trip(&client6.ns, (VIP6, 53).into()).context("IPv6 ClusterIP").with_context(|| agent.logs())?;
    let v6 = later_fragments(&agent, &node.ns)? - v4;
    assert_eq!(v6, 6.0, "later fragments followed (IPv6)");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_external_client_of_a_node_port_gets_a_fragmented_answer_whole() -> Result<()> {
    let mut node = Node::new("fragnp")?;
    let backend = node.add_pod("backend", BACKEND)?;
    let ext = node.add_external("ext", NODE_IP, &[EXTERNAL_IP], &[])?;
    let _mirror = Mirror::start(&backend.ns, (BACKEND, TARGET).into())?;
    let bpffs = Bpffs::new("fragnp")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    let manifest = one_port_service("dns", NODE_VIP.into(), 53, TARGET, "UDP", BACKEND.into(), Some(NODE_PORT));
    std::fs::write(dir.path().join("svc.yaml"), manifest)?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    round_trip(&ext.ns, (NODE_IP, NODE_PORT).into()).context("NodePort").with_context(|| agent.logs())?;
    // Two later fragments each way, each at ingress and again at egress
    // (the request's masqueraded there).
    let later = later_fragments(&agent, &node.ns)?;
    assert_eq!(later, 8.0, "later fragments followed");
    let m = agent.scrape(&node.ns)?;
    let masqueraded = m.get(r#"ebpf_proxy_packets_total{verdict="translated",reason="masqueraded"}"#).copied();
    assert_eq!(masqueraded, Some(1.0), "the NodePort flow is masqueraded");
    Ok(())
}
