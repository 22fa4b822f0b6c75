//! ClusterIP with real sockets: a node namespace running the agent, backend
//! pods running echo servers, a client pod. Covers issue 2's acceptance:
//! every backend reached and nothing else, replies from the dialled
//! ClusterIP:port, live manifest changes, a veth that appears after the agent
//! started, and a bad manifest that is reported while service continues.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, dumped_backends, tc_attached, wait_until},
    bpffs::Bpffs,
    echo::{EchoServer, Reply, tcp_request, udp_request},
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_service},
    netns::Netns,
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const REQUESTS: usize = 20;
const TIMEOUT: Duration = Duration::from_secs(10);

fn backend_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 0, 10 + n)
}

/// Sends `REQUESTS` TCP connections and UDP request/replies and returns the
/// backends that answered, checking each reply came from the ClusterIP:port
/// dialled and that the backend saw the client's own address.
fn exercise(client: &Netns, client_ip: Ipv4Addr) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
    let tcp_vip = SocketAddr::from((CLUSTER_IP, TCP_PORT));
    let udp_vip = SocketAddr::from((CLUSTER_IP, UDP_PORT));
    let check = |r: &Reply, vip: SocketAddr| -> Result<()> {
        anyhow::ensure!(r.from == vip, "reply from {} instead of {vip}", r.from);
        anyhow::ensure!(r.seen_client.starts_with(&format!("{client_ip}:")), "backend saw {}", r.seen_client);
        Ok(())
    };
    let mut tcp = BTreeSet::new();
    let mut udp = BTreeSet::new();
    for i in 0..REQUESTS {
        let r = tcp_request(client, tcp_vip).with_context(|| format!("tcp request {i}"))?;
        check(&r, tcp_vip)?;
        tcp.insert(r.backend);
        let r = udp_request(client, udp_vip).with_context(|| format!("udp request {i}"))?;
        check(&r, udp_vip)?;
        udp.insert(r.backend);
    }
    Ok((tcp, udp))
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn cluster_ip_reaches_every_backend_and_follows_manifest_changes() -> Result<()> {
    let mut node = Node::new("cip")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let b1 = node.add_pod("backend-1", backend_ip(1))?;
    let b2 = node.add_pod("backend-2", backend_ip(2))?;
    let mut servers = Vec::new();
    for pod in [&b1, &b2] {
        servers.push(EchoServer::start(&pod.ns, &pod.name, TCP_TARGET)?);
        servers.push(EchoServer::start(&pod.ns, &pod.name, UDP_TARGET)?);
    }

    // veths offload TX checksums: the client's packets reach the node with a
    // partial checksum, the case where hand-made checksum updates go wrong.
    let offload = client.ns.command("ethtool").args(["-k", "eth0"]).output()?;
    assert!(
        String::from_utf8_lossy(&offload.stdout).contains("tx-checksumming: on"),
        "expected TX checksum offload on the client's veth"
    );

    let bpffs = Bpffs::new("cip")?;
    let manifests = tempfile::tempdir()?;
    let svc_file = manifests.path().join("echo.yaml");
    std::fs::write(&svc_file, echo_service("demo", "echo", CLUSTER_IP, &[backend_ip(1), backend_ip(2)]))?;
    let root = bpffs.path().join("agent");
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    // Phase 1: both backends, nothing else.
    let (tcp, udp) = exercise(&client.ns, client.ip).with_context(|| agent.logs())?;
    assert_eq!(tcp, names(&["backend-1", "backend-2"]), "TCP");
    assert_eq!(udp, names(&["backend-1", "backend-2"]), "UDP");

    // Phase 2: a pod whose veth appears after the agent started joins, and
    // backend-1 leaves the manifest; a broken file lands next to it.
    let b3 = node.add_pod("backend-3", backend_ip(3))?;
    servers.push(EchoServer::start(&b3.ns, &b3.name, TCP_TARGET)?);
    servers.push(EchoServer::start(&b3.ns, &b3.name, UDP_TARGET)?);
    wait_until("attach to the new pod's veth", TIMEOUT, || tc_attached(&node.ns, &b3.host_if))?;
    let broken = manifests.path().join("broken.yaml");
    std::fs::write(&broken, "apiVersion: v1\nkind: Service\nmetadata:\n  name: [unclosed\n")?;
    std::fs::write(&svc_file, echo_service("demo", "echo", CLUSTER_IP, &[backend_ip(2), backend_ip(3)]))?;
    let want = vec![format!("{}:{TCP_TARGET}", backend_ip(2)), format!("{}:{TCP_TARGET}", backend_ip(3))];
    wait_until("the manifest change in the maps", TIMEOUT, || {
        Ok(dumped_backends(&root, &format!("{CLUSTER_IP}:{TCP_PORT}/TCP"))? == want)
    })?;

    let (tcp, udp) = exercise(&client.ns, client.ip).with_context(|| agent.logs())?;
    assert_eq!(tcp, names(&["backend-2", "backend-3"]), "TCP after the change");
    assert_eq!(udp, names(&["backend-2", "backend-3"]), "UDP after the change");

    // The broken file is reported with its path, line and reason.
    let located = format!("bad manifest {}:", broken.display());
    wait_until("the bad manifest reported", TIMEOUT, || {
        Ok(agent.logs().lines().any(|l| {
            l.split_once(&located).is_some_and(|(_, rest)| rest.starts_with(|c: char| c.is_ascii_digit()) && rest.contains("did not find expected"))
        }))
    })
    .with_context(|| agent.logs())?;
    Ok(())
}
