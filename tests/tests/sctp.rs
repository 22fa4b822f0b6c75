//! SCTP through a ClusterIP with real packets between namespaces. The kernel
//! here has no SCTP module, so the client and the backend send crafted SCTP
//! (raw IPv4 sockets of protocol 132) and capture with packet sockets: the
//! backend must see its own address and the targetPort with a CRC32c the
//! `crc32c` crate accepts, and the client the ClusterIP:port it dialled.
//!
//! Through a NodePort from a host outside the cluster (externalTrafficPolicy
//! Cluster), the flow is also masqueraded: the backend sees the node's
//! address, and the reply goes back through the node.
//!
//! A second association is sent the way a locally generated packet with
//! checksum offload looks (CHECKSUM_PARTIAL, via a packet socket with a
//! virtio_net_hdr): its CRC is computed later, so the datapath must leave
//! the field alone while it rewrites the port.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, trace_json},
    bpffs::Bpffs,
    manifests::sctp_service,
    sctp::{self, CHUNK_ABORT, CHUNK_DATA, CHUNK_INIT, CHUNK_INIT_ACK, Capture, chunk},
    topology::{Node, mac_of},
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const PORT: u16 = 2905;
const TARGET: u16 = 3905;
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const TIMEOUT: Duration = Duration::from_secs(10);
const WAIT: Duration = Duration::from_secs(3);

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const NODE_PORT: u16 = 30905;

const CLIENT_TAG: u32 = 0x0a0b_0c0d;
const SERVER_TAG: u32 = 0x1a1b_1c1d;

fn service_yaml() -> String {
    sctp_service(CLUSTER_IP, PORT, TARGET, NODE_PORT, BACKEND_IP)
}

fn check_seen(what: &str, got: &sctp::Seen, src: SocketAddrV4, dst: SocketAddrV4, chunk: u8) -> Result<()> {
    anyhow::ensure!(got.src == src && got.dst == dst, "{what}: {} -> {}, want {src} -> {dst}", got.src, got.dst);
    anyhow::ensure!(got.ip_checksum_ok, "{what}: IPv4 header checksum wrong");
    anyhow::ensure!(
        got.crc_ok(),
        "{what}: CRC32c {:#010x}, the reference computes {:#010x}",
        got.stored_crc,
        got.reference_crc
    );
    anyhow::ensure!(got.chunks == [chunk], "{what}: chunks {:?}, want [{chunk}]", got.chunks);
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn sctp_cluster_ip_translates_ports_with_valid_crc_both_ways() -> Result<()> {
    let mut node = Node::new("sctp")?;
    let client = node.add_pod("client", CLIENT_IP)?;
    let backend = node.add_pod("backend", BACKEND_IP)?;

    let bpffs = Bpffs::new("sctp")?;
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("sig.yaml"), service_yaml())?;
    let root = bpffs.path().join("agent");
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let vip = SocketAddrV4::new(CLUSTER_IP, PORT);
    let at_backend = Capture::open(&backend.ns, "eth0")?;
    let at_client = Capture::open(&client.ns, "eth0")?;

    // INIT, INIT-ACK, DATA both ways, ABORT: each direction checked where it lands.
    let c = SocketAddrV4::new(CLIENT_IP, 40000);
    let b = SocketAddrV4::new(BACKEND_IP, TARGET);
    let steps: [(&str, bool, u32, Vec<u8>, u8); 5] = [
        ("INIT", true, 0, chunk::init(CLIENT_TAG), CHUNK_INIT),
        ("INIT-ACK", false, CLIENT_TAG, chunk::init_ack(SERVER_TAG, b"state cookie"), CHUNK_INIT_ACK),
        ("DATA", true, SERVER_TAG, chunk::data(1, b"ASP Up"), CHUNK_DATA),
        ("DATA reply", false, CLIENT_TAG, chunk::data(100, b"ASP Up Ack"), CHUNK_DATA),
        ("ABORT", true, SERVER_TAG, chunk::abort(), CHUNK_ABORT),
    ];
    for (what, from_client, vtag, ch, kind) in steps {
        if from_client {
            let sent = sctp::packet(c.port(), PORT, vtag, &[ch]);
            sctp::send_raw(&client.ns, CLUSTER_IP, sent.clone())?;
            let got = at_backend.next(WAIT, |s| s.src == c).with_context(|| format!("{what} at the backend"))?;
            check_seen(what, &got.seen, c, b, kind).with_context(|| agent.logs())?;
            // The port changed, so the CRC had to: the program patched it.
            anyhow::ensure!(got.seen.stored_crc != sctp::stored_checksum(&sent), "{what}: CRC unchanged by a port rewrite");
        } else {
            sctp::send_raw(&backend.ns, CLIENT_IP, sctp::packet(TARGET, c.port(), vtag, &[ch]))?;
            let got = at_client.next(WAIT, |s| s.dst == c).with_context(|| format!("{what} at the client"))?;
            check_seen(what, &got.seen, vip, c, kind).with_context(|| agent.logs())?;
        }
    }

    // trace builds an SCTP INIT too, and reads the same decision (from a new
    // client port: the flow above is still tracked).
    let t = trace_json(&root, &format!("{CLIENT_IP}:40100"), &format!("{vip}/SCTP"))?;
    assert_eq!((t["verdict"].as_str(), t["type"].as_str()), (Some("ACCEPT"), Some("ClusterIP")), "{t:#}");
    assert_eq!(t["candidates"], serde_json::json!([b.to_string()]), "{t:#}");

    // A packet whose CRC is left to the kernel (CHECKSUM_PARTIAL), its field
    // zero as the SCTP stack leaves it for offload. The backend's node-side
    // veth keeps TX offload so the packet reaches the backend still partial:
    // a veth finishing it in software would write a ones'-complement sum
    // there (the packet socket path cannot mark an skb as CRC32c).
    let out = node.ns.command("ethtool").args(["-K", &backend.host_if, "tx", "on"]).output()?;
    anyhow::ensure!(out.status.success(), "ethtool tx on: {}", String::from_utf8_lossy(&out.stderr));
    let c2 = SocketAddrV4::new(CLIENT_IP, 40001);
    let mut sent = sctp::packet(c2.port(), PORT, 0, &[chunk::init(CLIENT_TAG)]);
    sent[8..12].fill(0);
    let frame = sctp::frame(
        CLIENT_IP.octets(),
        CLUSTER_IP.octets(),
        &sent,
        parse_mac(&mac_of(&client.ns, "eth0")?)?,
        parse_mac(&mac_of(&node.ns, &client.host_if)?)?,
    );
    sctp::send_checksum_partial(&client.ns, "eth0", frame)?;
    let got = at_backend.next(WAIT, |s| s.src == c2).context("offloaded INIT at the backend")?;
    anyhow::ensure!(got.checksum_not_ready, "the offloaded INIT arrived with a final checksum: the test did not exercise CHECKSUM_PARTIAL");
    anyhow::ensure!(got.seen.dst == b, "offloaded INIT went to {}, want {b}", got.seen.dst);
    anyhow::ensure!(
        got.seen.stored_crc == 0,
        "offloaded INIT: CRC field {:#010x}, want it left at 0 for the kernel to compute\n{}",
        got.seen.stored_crc,
        agent.logs()
    );
    Ok(())
}

fn parse_mac(text: &str) -> Result<[u8; 6]> {
    let bytes: Vec<u8> = text.split(':').map(|h| u8::from_str_radix(h, 16)).collect::<Result<_, _>>()?;
    bytes.try_into().map_err(|_| anyhow::anyhow!("MAC {text:?}"))
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn sctp_node_port_from_outside_is_masqueraded_with_valid_crc() -> Result<()> {
    let mut node = Node::new("sctpnp")?;
    let backend = node.add_pod("backend", BACKEND_IP)?;
    let ext = node.add_external("ext", NODE_IP, &[EXTERNAL], &[])?;

    let bpffs = Bpffs::new("sctpnp")?;
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("sig.yaml"), service_yaml())?;
    let root = bpffs.path().join("agent");
    let flags = ["--cluster-cidr", "10.244.0.0/16", "--service-cidr", "10.96.0.0/16"];
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &flags)?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let at_backend = Capture::open(&backend.ns, "eth0")?;
    let at_ext = Capture::open(&ext.ns, "eth0")?;
    let client = SocketAddrV4::new(EXTERNAL, 40000);
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);

    let sent = sctp::packet(client.port(), NODE_PORT, 0, &[chunk::init(CLIENT_TAG)]);
    sctp::send_raw(&ext.ns, NODE_IP, sent)?;
    // Masqueraded: from the node, on whatever port the SNAT table chose.
    let got = at_backend.next(WAIT, |s| *s.src.ip() == NODE_IP).context("INIT at the backend")?;
    let seen_from = got.seen.src;
    check_seen("INIT via NodePort", &got.seen, seen_from, SocketAddrV4::new(BACKEND_IP, TARGET), CHUNK_INIT)
        .with_context(|| agent.logs())?;

    let reply = sctp::packet(TARGET, seen_from.port(), CLIENT_TAG, &[chunk::init_ack(SERVER_TAG, b"cookie")]);
    sctp::send_raw(&backend.ns, NODE_IP, reply)?;
    let got = at_ext.next(WAIT, |s| s.dst == client).context("INIT-ACK at the external client")?;
    check_seen("INIT-ACK via NodePort", &got.seen, node_port, client, CHUNK_INIT_ACK).with_context(|| agent.logs())?;
    Ok(())
}
