//! Masquerade against a backend's TIME_WAIT: external clients open one
//! server-closed TCP connection after another through a NodePort
//! (externalTrafficPolicy Cluster, so masqueraded), the backend closing
//! first and so keeping each (node address and port, backend) tuple in
//! TIME_WAIT for 60 s. A SYN another client sends on such a tuple is
//! answered with a bare ACK unless its sequence number or timestamp happens
//! to be newer, and the client retries a second later. Masquerade must never
//! hand a new connection a tuple of another client's that the backend may
//! still hold: no connect here may need a SYN sent twice (TCP_INFO's
//! total_retrans, read right after connect: a count, not a timing).
//!
//! Several client addresses take turns, as many clients behind a NodePort
//! do: one address alone would pass the backend's TIME_WAIT check on its
//! timestamps, which Linux offsets per address pair, not per port.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_common::Counter;
use proxy_tests::{
    agent::Agent,
    bench::load::{Server, request, server_closed_once},
    bpffs::Bpffs,
    topology::{External, Node, Pod},
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const CLIENTS: [Ipv4Addr; 4] = [
    Ipv4Addr::new(203, 0, 113, 2),
    Ipv4Addr::new(203, 0, 113, 3),
    Ipv4Addr::new(203, 0, 113, 4),
    Ipv4Addr::new(203, 0, 113, 5),
];
const NODE_PORT: u16 = 30080;
const TARGET: u16 = 8080;
const CONNECTIONS: usize = 4000;
/// One connection at most every this: a steady rate (500/s) over several
/// seconds, so the connections of the first seconds have closed long ago
/// (by the second) when the last ones open, but not by TIME_WAIT's 60 s.
const PACE: Duration = Duration::from_millis(2);
/// Past a retransmission TCP's first SYN timeout (1 s) has passed: generous.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Stop early once this many connects needed a retransmission: the verdict
/// is clear, and each costs a second.
const ENOUGH_FAILURES: usize = 20;

fn manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo}}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{{name: tcp, port: 80, targetPort: {TARGET}, nodePort: {NODE_PORT}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: demo, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: tcp, port: {TARGET}}}]
endpoints:
- {{addresses: [{BACKEND}], conditions: {{ready: true}}, nodeName: node-a}}
"#
    )
}

/// A node with the agent, the backend pod (its server closes first when
/// asked) and the external host, torn down when dropped.
struct Setup {
    // Drop order: the agent, then the server, then the namespaces.
    agent: Agent,
    root: std::path::PathBuf,
    _server: Server,
    _bpffs: Bpffs,
    _dir: tempfile::TempDir,
    ext: External,
    _backend: Pod,
    node: Node,
}

fn setup(label: &str) -> Result<Setup> {
    let mut node = Node::new(label)?;
    let backend = node.add_pod("backend", BACKEND)?;
    let ext = node.add_external("ext", NODE_IP, &CLIENTS, &[])?;
    let server = Server::start(&backend.ns, TARGET, 2, &[], 0)?;
    let bpffs = Bpffs::new(label)?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), manifests())?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &["--cluster-cidr", "10.244.0.0/16"])?;
    agent.wait_healthy(&node.ns, Duration::from_secs(10))?;
    Ok(Setup { agent, root, _server: server, _bpffs: bpffs, _dir: dir, ext, _backend: backend, node })
}

fn counter(root: &std::path::Path, c: Counter) -> Result<u64> {
    Ok(proxy_user::maps::Maps::open_pinned(root)?.read_counters()?[c as usize])
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn server_closed_connections_through_a_node_port_never_meet_time_wait() -> Result<()> {
    let Setup { agent, root, ext, .. } = &setup("timewait")?;
    let to = SocketAddr::from((NODE_IP, NODE_PORT));
    // (connection, retransmissions, connect time) of each that retransmitted.
    type Run = (Vec<(usize, u32, Duration)>, Duration, usize);
    let (retransmitted, max_connect, done) = ext.ns.run(move || -> Result<Run> {
        let mut retransmitted = Vec::new();
        let mut max_connect = Duration::ZERO;
        let start = std::time::Instant::now();
        for i in 0..CONNECTIONS {
            if let Some(wait) = (start + PACE * i as u32).checked_duration_since(std::time::Instant::now()) {
                std::thread::sleep(wait);
            }
            let from = IpAddr::V4(CLIENTS[i % CLIENTS.len()]);
            let c = server_closed_once(Some(from), to, CONNECT_TIMEOUT)
                .with_context(|| format!("connection {i} from {from}"))?;
            max_connect = max_connect.max(c.connect);
            if c.retransmits > 0 {
                retransmitted.push((i, c.retransmits, c.connect));
                if retransmitted.len() == ENOUGH_FAILURES {
                    return Ok((retransmitted, max_connect, i + 1));
                }
            }
        }
        Ok((retransmitted, max_connect, CONNECTIONS))
    })??;
    let shared = counter(root, Counter::SnatPortShared)?;
    println!(
        "{done} server-closed connections through the NodePort: {} needed a SYN retransmission, \
         longest connect {max_connect:?}, snat_port_shared {shared}",
        retransmitted.len()
    );
    assert!(
        retransmitted.is_empty(),
        "connects that sent their SYN again (connection, retransmissions, connect time): {retransmitted:?}\n{}",
        agent.logs()
    );
    assert_eq!(done, CONNECTIONS);
    Ok(())
}

/// The other way round: an external client's masqueraded connection keeps
/// its port P (inside the node's ephemeral range, no node socket on it);
/// then a node process connects straight to the backend from the node
/// address and that same port P (as kubelet's probes or the socket hooks
/// do, here bound explicitly rather than left to chance). Both tuples
/// would be (node address:P, backend): the node's connection leaves with a
/// port of its own, and each gets its own replies.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_node_socket_on_a_masqueraded_flows_port_gets_its_own() -> Result<()> {
    let Setup { root, ext, node, .. } = &setup("nodesnat")?;
    const P: u16 = 40123;
    let bound = |ns: &proxy_tests::netns::Netns, from: Ipv4Addr, to: SocketAddr| -> Result<std::net::TcpStream> {
        ns.run(move || -> Result<std::net::TcpStream> {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
            s.bind(&SocketAddr::from((from, P)).into())?;
            s.connect_timeout(&to.into(), Duration::from_secs(3))
                .with_context(|| format!("connect {from}:{P} -> {to}"))?;
            let s: std::net::TcpStream = s.into();
            s.set_read_timeout(Some(Duration::from_secs(3)))?;
            Ok(s)
        })?
    };
    let mut external = bound(&ext.ns, CLIENTS[0], (NODE_IP, NODE_PORT).into())?;
    request(&mut external).context("the external client's first request")?;
    let mut local = bound(&node.ns, NODE_IP, (BACKEND, TARGET).into()).context("the node's connection")?;
    for round in 0..3 {
        request(&mut local).with_context(|| format!("the node's request {round}"))?;
        request(&mut external).with_context(|| format!("the external client's request {round}"))?;
    }
    assert_eq!(counter(root, Counter::NodeSnat)?, 1, "the node's connection got its own port once");
    Ok(())
}
