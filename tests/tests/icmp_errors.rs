//! ICMP errors about translated flows, with real traffic, in the production
//! topology (pods under the socket hooks, which leave pods' sockets to TC):
//! - a pod's connected UDP socket to a ClusterIP whose backend port is
//!   closed gets ECONNREFUSED (the backend's port unreachable, its quote
//!   translated back at egress), IPv4 and IPv6;
//! - so does an external client of a NodePort, whose flow is masqueraded
//!   (the error reaches the node's address first and goes back to the client
//!   at ingress);
//! - a 4 MiB upload from a pod to a ClusterIP whose backend sits behind a
//!   router with a smaller MTU on its far link completes, IPv4 and IPv6:
//!   the router's fragmentation needed / packet too big reaches the pod's
//!   socket. Without the translation the pod never learns the path MTU and
//!   the upload stalls for good (the hang guard below turns that into a
//!   failure).

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    addrs::{BACKEND, BACKEND6, CLIENT, CLIENT6, VIP, VIP6},
    agent::Agent,
    bpffs::Bpffs,
    echo::{expect_refused, udp_request_connected},
    manifests::{echo_node_port_service, one_port_service},
    topology::Node,
};

const TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer may take before the test calls the flow stalled: a
/// hang guard, far above what a working path needs.
const STALLED: Duration = Duration::from_secs(60);
const UPLOAD: usize = 4 << 20;
const UPLOAD_TARGET: u16 = 8080;

/// The backend behind the router.
const FAR: Ipv4Addr = Ipv4Addr::new(10, 244, 5, 11);
const FAR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 5, 0, 0, 0, 0, 0x11);
const FAR_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const FAR_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
const HOP_MTU: u32 = 1400;

/// A single-stack ClusterIP Service (see `one_port_service`).
fn service(name: &str, vip: IpAddr, port: u16, target: u16, proto: &str, backend: IpAddr) -> String {
    one_port_service(name, vip, port, target, proto, backend, None)
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_udp_client_of_a_cluster_ip_whose_backend_port_is_closed_is_refused() -> Result<()> {
    let mut node = Node::new("icmpref")?;
    let client = node.add_pod("client", CLIENT)?;
    let client6 = node.add_pod("client6", CLIENT6)?;
    // Nothing listens on the backends' UDP port.
    let _backend = node.add_pod("backend", BACKEND)?;
    let _backend6 = node.add_pod("backend6", BACKEND6)?;
    let bpffs = Bpffs::new("icmpref")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    let manifests = [
        service("dns", VIP.into(), 53, 5353, "UDP", BACKEND.into()),
        service("dns6", VIP6.into(), 53, 5353, "UDP", BACKEND6.into()),
    ];
    std::fs::write(dir.path().join("svc.yaml"), manifests.join("---\n"))?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    expect_refused(udp_request_connected(&client.ns, SocketAddr::from((VIP, 53)), TIMEOUT), "IPv4 ClusterIP")
        .with_context(|| agent.logs())?;
    expect_refused(udp_request_connected(&client6.ns, SocketAddr::from((VIP6, 53)), TIMEOUT), "IPv6 ClusterIP")
        .with_context(|| agent.logs())?;
    let m = agent.scrape(&node.ns)?;
    let translated = m.get(r#"ebpf_proxy_packets_total{verdict="translated",reason="icmp_error_translated"}"#).copied();
    assert!(translated.is_some_and(|n| n >= 2.0), "translated ICMP errors: {translated:?}");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_external_udp_client_of_a_node_port_whose_backend_port_is_closed_is_refused() -> Result<()> {
    const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 79, 1);
    const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 79, 2);
    const UDP_NODE_PORT: u16 = 30053;
    let mut node = Node::new("icmpnp")?;
    let _backend = node.add_pod("backend", BACKEND)?;
    let ext = node.add_external("ext", NODE_IP, &[EXTERNAL_IP], &[])?;
    let bpffs = Bpffs::new("icmpnp")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), echo_node_port_service(VIP, &[BACKEND], 30080, UDP_NODE_PORT))?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    expect_refused(udp_request_connected(&ext.ns, SocketAddr::from((NODE_IP, UDP_NODE_PORT)), TIMEOUT), "NodePort")
        .with_context(|| agent.logs())?;
    Ok(())
}

/// Accepts `count` connections in `ns` on port UPLOAD_TARGET (both
/// families), reads each to its end and answers with the byte count.
fn upload_sink(ns: &proxy_tests::netns::Netns, count: usize) -> Result<std::thread::JoinHandle<std::io::Result<()>>> {
    let listener = ns.run(|| TcpListener::bind(("::", UPLOAD_TARGET)))??;
    ns.spawn(move || {
        for _ in 0..count {
            let (mut conn, _) = listener.accept()?;
            conn.set_read_timeout(Some(STALLED))?;
            let mut buf = vec![0u8; 64 << 10];
            let mut total = 0usize;
            loop {
                match conn.read(&mut buf)? {
                    0 => break,
                    n => total += n,
                }
            }
            conn.write_all(format!("{total}\n").as_bytes())?;
        }
        Ok(())
    })
}

/// Sends UPLOAD bytes to `to` from `ns` and returns what the sink counted.
fn upload(ns: &proxy_tests::netns::Netns, to: SocketAddr) -> Result<usize> {
    ns.run(move || -> Result<usize> {
        let mut s = TcpStream::connect_timeout(&to, TIMEOUT)?;
        s.set_write_timeout(Some(STALLED))?;
        s.set_read_timeout(Some(STALLED))?;
        let chunk = vec![0x5au8; 64 << 10];
        let mut sent = 0;
        while sent < UPLOAD {
            s.write_all(&chunk).with_context(|| format!("upload to {to} stalled after {sent} bytes"))?;
            sent += chunk.len();
        }
        s.shutdown(Shutdown::Write)?;
        let mut reply = String::new();
        s.read_to_string(&mut reply).with_context(|| format!("no answer from {to} after the upload"))?;
        Ok(reply.trim().parse()?)
    })?
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_upload_to_a_cluster_ip_behind_a_smaller_mtu_finds_the_path_mtu() -> Result<()> {
    let mut node = Node::new("icmpmtu")?;
    let client = node.add_pod("client", CLIENT)?;
    let client6 = node.add_pod("client6", CLIENT6)?;
    let far = node.add_routed_pod("far", &[FAR.into(), FAR6.into()], HOP_MTU, [192, 168, 80], "fd00:80")?;
    let sink = upload_sink(&far.pod, 2)?;
    let bpffs = Bpffs::new("icmpmtu")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    let manifests = [
        service("up", FAR_VIP.into(), 80, UPLOAD_TARGET, "TCP", FAR.into()),
        service("up6", FAR_VIP6.into(), 80, UPLOAD_TARGET, "TCP", FAR6.into()),
    ];
    std::fs::write(dir.path().join("svc.yaml"), manifests.join("---\n"))?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    for (ns, vip) in [(&client.ns, IpAddr::from(FAR_VIP)), (&client6.ns, IpAddr::from(FAR_VIP6))] {
        let counted = upload(ns, SocketAddr::new(vip, 80)).with_context(|| agent.logs())?;
        assert_eq!(counted, UPLOAD, "bytes the backend behind {vip} received");
    }
    sink.join().expect("sink thread")?;
    let m = agent.scrape(&node.ns)?;
    let translated = m.get(r#"ebpf_proxy_packets_total{verdict="translated",reason="icmp_error_translated"}"#).copied();
    assert!(translated.is_some_and(|n| n >= 2.0), "translated ICMP errors: {translated:?}");
    Ok(())
}
