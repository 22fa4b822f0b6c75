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
    topology::{Node, Pod},
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

/// A node running the agent on a ClusterIP with backend-1 and backend-2
/// (echo servers for TCP and UDP), and a client pod.
struct World {
    agent: Agent,
    root: std::path::PathBuf,
    manifests: tempfile::TempDir,
    svc_file: std::path::PathBuf,
    servers: Vec<EchoServer>,
    _bpffs: Bpffs,
    _backends: Vec<Pod>,
    client: Pod,
    node: Node,
}

fn world(label: &str) -> Result<World> {
    let mut node = Node::new(label)?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let (mut servers, mut backends) = (Vec::new(), Vec::new());
    for n in [1, 2] {
        let pod = node.add_pod(&format!("backend-{n}"), backend_ip(n))?;
        servers.push(EchoServer::start(&pod.ns, &pod.name, TCP_TARGET)?);
        servers.push(EchoServer::start(&pod.ns, &pod.name, UDP_TARGET)?);
        backends.push(pod);
    }
    let bpffs = Bpffs::new(label)?;
    let manifests = tempfile::tempdir()?;
    let svc_file = manifests.path().join("echo.yaml");
    std::fs::write(&svc_file, echo_service("demo", "echo", CLUSTER_IP, &[backend_ip(1), backend_ip(2)]))?;
    let root = bpffs.path().join("agent");
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    Ok(World { agent, root, manifests, svc_file, servers, _bpffs: bpffs, _backends: backends, client, node })
}

impl World {
    /// Points the Service at `backends` and waits until the maps say so.
    fn set_backends(&self, backends: &[u8]) -> Result<()> {
        let ips: Vec<Ipv4Addr> = backends.iter().map(|n| backend_ip(*n)).collect();
        std::fs::write(&self.svc_file, echo_service("demo", "echo", CLUSTER_IP, &ips))?;
        let want: Vec<String> = ips.iter().map(|ip| format!("{ip}:{TCP_TARGET}")).collect();
        wait_until("the manifest change in the maps", TIMEOUT, || {
            Ok(dumped_backends(&self.root, &format!("{CLUSTER_IP}:{TCP_PORT}/TCP"))? == want)
        })
    }

    fn exercise(&self) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
        exercise(&self.client.ns, self.client.ip).with_context(|| self.agent.logs())
    }
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn cluster_ip_reaches_every_backend_and_nothing_else() -> Result<()> {
    let w = world("cip")?;
    // veths offload TX checksums: the client's packets reach the node with a
    // partial checksum, the case where hand-made checksum updates go wrong.
    let offload = w.client.ns.command("ethtool").args(["-k", "eth0"]).output()?;
    assert!(
        String::from_utf8_lossy(&offload.stdout).contains("tx-checksumming: on"),
        "expected TX checksum offload on the client's veth"
    );
    let (tcp, udp) = w.exercise()?;
    assert_eq!(tcp, names(&["backend-1", "backend-2"]), "TCP");
    assert_eq!(udp, names(&["backend-1", "backend-2"]), "UDP");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_backend_removed_from_the_manifest_gets_no_more_traffic() -> Result<()> {
    let w = world("cipdel")?;
    w.set_backends(&[2])?;
    let (tcp, udp) = w.exercise()?;
    assert_eq!(tcp, names(&["backend-2"]), "TCP after the change");
    assert_eq!(udp, names(&["backend-2"]), "UDP after the change");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_pod_whose_veth_appears_after_the_agent_started_is_served() -> Result<()> {
    let mut w = world("cipnew")?;
    let b3 = w.node.add_pod("backend-3", backend_ip(3))?;
    w.servers.push(EchoServer::start(&b3.ns, &b3.name, TCP_TARGET)?);
    w.servers.push(EchoServer::start(&b3.ns, &b3.name, UDP_TARGET)?);
    wait_until("attach to the new pod's veth", TIMEOUT, || tc_attached(&w.node.ns, &b3.host_if))?;
    w.set_backends(&[2, 3])?;
    let (tcp, udp) = w.exercise()?;
    assert_eq!(tcp, names(&["backend-2", "backend-3"]), "TCP with the new pod");
    assert_eq!(udp, names(&["backend-2", "backend-3"]), "UDP with the new pod");
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_bad_manifest_is_reported_with_its_line_and_service_continues() -> Result<()> {
    let w = world("cipbad")?;
    let broken = w.manifests.path().join("broken.yaml");
    std::fs::write(&broken, "apiVersion: v1\nkind: Service\nmetadata:\n  name: [unclosed\n")?;
    // The broken file is reported with its path, line and reason.
    let located = format!("bad manifest {}:", broken.display());
    wait_until("the bad manifest reported", TIMEOUT, || {
        Ok(w.agent.logs().lines().any(|l| {
            l.split_once(&located).is_some_and(|(_, rest)| rest.starts_with(|c: char| c.is_ascii_digit()) && rest.contains("did not find expected"))
        }))
    })
    .with_context(|| w.agent.logs())?;
    // The good file next to it is still served, and still followed.
    let (tcp, udp) = w.exercise()?;
    assert_eq!((tcp, udp), (names(&["backend-1", "backend-2"]), names(&["backend-1", "backend-2"])), "with a bad manifest");
    w.set_backends(&[1])?;
    let (tcp, udp) = w.exercise()?;
    assert_eq!((tcp, udp), (names(&["backend-1"]), names(&["backend-1"])), "a change next to a bad manifest");
    Ok(())
}
