//! Real SCTP associations, made by the kernel's SCTP stack: INIT to
//! SHUTDOWN with data both ways, through a ClusterIP and a NodePort whose
//! port differs from the targetPort (so every packet's CRC32c is patched),
//! from a pod, from another host (a node outside this one, masqueraded) and
//! from a process on the node, with checksum offload on and then off on
//! every interface involved. SCTP's connect() runs no cgroup hook (the
//! kernel calls them from TCP's and UDP's paths only): the node's INIT is
//! translated at TC egress of the interface its route to the ClusterIP
//! picked; see docs/sctp.md.
//!
//! It needs the sctp module. The development machines' kernel has none (the
//! crafted-packet tests in sctp.rs stand in there): without it the test says
//! so and passes, unless EBPF_PROXY_REQUIRE_SCTP is set, as `./x vm-test`
//! sets it on Debian's kernels, which have the module.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{net::Ipv4Addr, path::Path, time::Duration};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::Agent,
    bpffs::Bpffs,
    echo::EchoServer,
    manifests::sctp_service,
    netns::Netns,
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const PORT: u16 = 2905;
const TARGET: u16 = 3905;
const NODE_PORT: u16 = 30905;
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);

fn service_yaml() -> String {
    sctp_service(CLUSTER_IP, PORT, TARGET, NODE_PORT, BACKEND_IP)
}

/// Whether this kernel makes SCTP sockets (loading the module if it can).
fn sctp_available() -> bool {
    socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, Some(socket2::Protocol::from(libc::IPPROTO_SCTP))).is_ok()
}

fn ethtool_tx(ns: &Netns, ifname: &str, on: bool) -> Result<()> {
    let out = ns.command("ethtool").args(["-K", ifname, "tx", if on { "on" } else { "off" }]).output()?;
    anyhow::ensure!(out.status.success(), "ethtool -K {ifname} tx: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// One association by `netprobe sctp`: the peer its socket reports and the
/// backend's answer (`backend <address it saw>`).
fn associate(mut cmd: std::process::Command, to: &str) -> Result<(String, String)> {
    let out = cmd.args(["sctp", to]).output().context("run netprobe")?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    anyhow::ensure!(out.status.success(), "netprobe sctp {to}: {}", String::from_utf8_lossy(&out.stderr));
    let field = |k: &str| text.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string);
    let peer = field("peer=").with_context(|| format!("netprobe sctp {to}: {text}"))?;
    let reply = text.split_once("reply=").map(|(_, r)| r.to_string()).unwrap_or_default();
    Ok((peer, reply))
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn sctp_associations_through_cluster_ip_and_node_port() -> Result<()> {
    if !sctp_available() {
        assert!(std::env::var_os("EBPF_PROXY_REQUIRE_SCTP").is_none(), "EBPF_PROXY_REQUIRE_SCTP is set but this kernel makes no SCTP socket");
        eprintln!("skipped: this kernel has no SCTP sockets (./x vm-test runs this on Debian's kernels)");
        return Ok(());
    }
    let mut node = Node::new("sctpk")?;
    let client = node.add_pod("client", CLIENT_IP)?;
    let backend = node.add_pod("backend", BACKEND_IP)?;
    let ext = node.add_external("ext", NODE_IP, &[EXTERNAL], &[])?;
    // The node's route to the ClusterIP (as a real node's default route).
    node.ns.ip(&["route", "add", "default", "via", &EXTERNAL.to_string()])?;
    let _echo = EchoServer::start_sctp(&backend.ns, "backend", TARGET)?;

    let bpffs = Bpffs::new("sctpk")?;
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("sig.yaml"), service_yaml())?;
    let root = bpffs.path().join("agent");
    let flags = ["--cluster-cidr", "10.244.0.0/16", "--service-cidr", "10.96.0.0/16"];
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &flags)?;
    agent.wait_healthy(&node.ns, Duration::from_secs(20))?;

    let netprobe = Path::new(env!("CARGO_BIN_EXE_netprobe"));
    let from_pod = || client.ns.command(netprobe.to_str().unwrap());
    let from_other_node = || ext.ns.command(netprobe.to_str().unwrap());
    let from_node = || node.ns.command(netprobe.to_str().unwrap());
    let cluster_ip = format!("{CLUSTER_IP}:{PORT}");
    let node_port = format!("{NODE_IP}:{NODE_PORT}");
    // (who, client, frontend dialled, source the backend must see; None: any node address)
    let cases: [(&str, &dyn Fn() -> std::process::Command, &str, Option<Ipv4Addr>); 4] = [
        ("pod to ClusterIP", &from_pod, &cluster_ip, Some(CLIENT_IP)),
        ("pod to NodePort", &from_pod, &node_port, None),
        ("another node to NodePort", &from_other_node, &node_port, Some(NODE_IP)),
        ("a process on the node to ClusterIP", &from_node, &cluster_ip, None),
    ];
    for offload in [true, false] {
        for (ns, ifname) in [
            (&node.ns, client.host_if.as_str()),
            (&node.ns, backend.host_if.as_str()),
            (&node.ns, ext.node_if.as_str()),
            (&client.ns, "eth0"),
            (&backend.ns, "eth0"),
            (&ext.ns, "eth0"),
        ] {
            ethtool_tx(ns, ifname, offload)?;
        }
        for (who, client, to, seen_from) in &cases {
            let what = format!("{who} (tx offload {})", if offload { "on" } else { "off" });
            let (peer, reply) = associate(client(), to).with_context(|| format!("{what}\n{}", agent.logs()))?;
            assert_eq!(&peer, to, "{what}: the socket's peer is the frontend dialled (reply {reply:?})");
            let seen = reply.strip_prefix("backend ").with_context(|| format!("{what}: reply {reply:?}\n{}", agent.logs()))?;
            if let Some(want) = seen_from {
                assert!(seen.starts_with(&format!("{want}:")), "{what}: the backend saw {seen}, want {want}");
            }
        }
    }
    Ok(())
}
