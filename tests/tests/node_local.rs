//! Services for processes on the node itself, translated at the socket by
//! the cgroup hooks: a node process reaches a ClusterIP and a NodePort over
//! TCP and UDP, sees the service address as its peer (getpeername, recvmsg),
//! gets ECONNREFUSED from a Service without endpoints, also from a secondary
//! node address, and a process outside the agent's cgroup is left alone. The
//! hooks outlive a SIGTERM and go with `cleanup`. The same for an IPv6
//! Service, through the IPv6 hooks, and for a process outside the agent's
//! cgroup, through TC egress (IPv6 here; IPv4 in conformance's
//! TestProductionPath), also to a NodePort on the node's own address,
//! which leaves through loopback.
//!
//! The hooks sit on the root above every pod, as on a real node, and leave
//! pods' sockets to TC: a pod's own `127.0.0.1:<nodePort>` stays its own,
//! and a pod reaching a NodePort is masqueraded as at its veth. The node's
//! network namespace is known by SO_NETNS_COOKIE, or on older kernels by a
//! probe socket of the agent's; both ways are tested.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::Agent,
    bpffs::Bpffs,
    cgroup::Cgroup,
    echo::EchoServer,
    netns::Netns,
    topology::{External, Node, Pod},
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const TIMEOUT: Duration = Duration::from_secs(10);

const MANIFESTS: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: demo, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: tcp, port: 8080}, {name: udp, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.0.11]}
- {addresses: [10.244.0.12]}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: demo}
spec:
  clusterIP: 10.96.0.12
  ports: [{name: tcp, port: 80}]
"#;

/// What a REJECTed connect() says: ECONNREFUSED where the socket hooks can
/// set the errno (bpf_set_retval, Linux 5.18), EPERM before that.
fn refused() -> Result<&'static str> {
    Ok(if proxy_user::kernel::probe()?.sock_set_retval { "error=ConnectionRefused" } else { "error=PermissionDenied" })
}

/// A node with backends b1 and b2 (10.244.0.11-12, TCP 8080 and UDP 5353,
/// the Service in MANIFESTS) and a LAN host. Field order is drop order.
struct World {
    _servers: Vec<EchoServer>,
    _lan: External,
    _backends: [Pod; 2],
    node: Node,
}

impl World {
    fn new(label: &str) -> Result<World> {
        let mut node = Node::new(label)?;
        let backends = [node.add_pod("b1", Ipv4Addr::new(10, 244, 0, 11))?, node.add_pod("b2", Ipv4Addr::new(10, 244, 0, 12))?];
        let lan = node.add_external("lan", NODE_IP, &[Ipv4Addr::new(203, 0, 113, 2)], &[])?;
        let mut servers = Vec::new();
        for p in &backends {
            servers.push(EchoServer::start(&p.ns, &p.name, 8080)?);
            servers.push(EchoServer::start(&p.ns, &p.name, 5353)?);
        }
        Ok(World { _servers: servers, _lan: lan, _backends: backends, node })
    }
}

/// `netprobe` as a node process: in the node's namespace and in `cg`.
fn probe(cg: &Cgroup, node: &Netns, proto: &str, to: &str) -> Result<String> {
    probe_from(cg, node, proto, to, None)
}

/// The same from a chosen source address.
fn probe_from(cg: &Cgroup, node: &Netns, proto: &str, to: &str, source: Option<&str>) -> Result<String> {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_netprobe"));
    let out = cg.command(node, bin).args([proto, to]).args(source).output().context("run netprobe")?;
    anyhow::ensure!(out.status.success(), "netprobe {proto} {to}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
#[ignore = "needs root (network namespaces, cgroups and BPF)"]
fn node_processes_reach_services_through_the_socket_hooks() -> Result<()> {
    let world = World::new("nodelocal")?;
    let node = &world.node;
    let cg = Cgroup::new("nodelocal")?;
    let outside_cg = Cgroup::outside("nodelocal")?;
    let bpffs = Bpffs::new("nodelocal")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), MANIFESTS)?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    for (proto, to, port) in [("tcp", "10.96.0.10:80", 8080), ("udp", "10.96.0.10:53", 5353), ("tcp", "192.168.0.2:30080", 8080)] {
        let answered = backends_answering(&cg, &node.ns, &agent, proto, to)?;
        assert_eq!(answered, BTreeSet::from(["b1".to_string(), "b2".to_string()]), "{proto} {to} (backend port {port})");
    }
    assert_eq!(probe(&cg, &node.ns, "tcp", "10.96.0.12:80")?, refused()?, "no endpoints: REJECT");
    // A node process bound to a secondary node address: the backend sees
    // that address and answers it.
    node.ns.ip(&["addr", "add", "192.168.0.5/32", "dev", "lo"])?;
    for (proto, to) in [("tcp", "10.96.0.10:80"), ("udp", "10.96.0.10:53")] {
        let line = probe_from(&cg, &node.ns, proto, to, Some("192.168.0.5"))?;
        assert!(line.starts_with(&format!("peer={to} reply=")), "{proto} {to} from 192.168.0.5: {line}\n{}", agent.logs());
        assert!(line.contains(" 192.168.0.5:"), "{proto} {to}: the backend saw another source: {line}");
    }
    // A process outside the agent's cgroup passes no socket hook. With no
    // route to the ClusterIP here its connect fails before any packet
    // exists; where a route exists TC egress translates it (conformance's
    // TestProductionPath).
    let outside = probe(&outside_cg, &node.ns, "tcp", "10.96.0.10:80")?;
    assert!(outside.starts_with("error="), "outside the cgroup: {outside}");
    // To a NodePort on the node's own address the packet exists: it leaves
    // through loopback, whose egress translates it, and its replies come
    // back in through loopback, which the agent lets accept them (they come
    // from a node address: a martian source on any interface that doesn't).
    let accept_local = node.ns.command("sysctl").args(["-n", "net.ipv4.conf.lo.accept_local"]).output()?;
    assert_eq!(String::from_utf8_lossy(&accept_local.stdout).trim(), "1", "the agent sets lo's accept_local");
    for proto in ["tcp", "udp"] {
        let to = if proto == "tcp" { "192.168.0.2:30080" } else { "192.168.0.2:30053" };
        let answered = backends_answering(&outside_cg, &node.ns, &agent, proto, to)?;
        assert_eq!(answered, BTreeSet::from(["b1".to_string(), "b2".to_string()]), "outside the cgroup: {proto} {to}");
    }
    // SIGTERM leaves the hooks serving; cleanup removes them.
    let status = agent.stop()?;
    assert!(status.success(), "agent exit status {status}");
    assert!(probe(&cg, &node.ns, "tcp", "10.96.0.10:80")?.starts_with("peer=10.96.0.10:80 "), "hooks kept after SIGTERM");
    let out = node.ns.command(proxy_tests::agent::agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    assert!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    let after = probe(&cg, &node.ns, "tcp", "10.96.0.10:80")?;
    assert!(after.starts_with("error="), "still translated after cleanup: {after}");
    Ok(())
}

const MANIFESTS_V6: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web6, namespace: demo}
spec:
  clusterIP: fd00:96::10
  ipFamilies: [IPv6]
  type: NodePort
  ports:
  - {name: tcp, port: 80, targetPort: 8080, nodePort: 30080}
  - {name: udp, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: demo, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: tcp, port: 8080}, {name: udp, port: 5353, protocol: UDP}]
endpoints:
- {addresses: ["fd00:244::11"]}
- {addresses: ["fd00:244::12"]}
---
apiVersion: v1
kind: Service
metadata: {name: empty6, namespace: demo}
spec:
  clusterIP: fd00:96::12
  ipFamilies: [IPv6]
  ports: [{name: tcp, port: 80}]
"#;

/// The backends that answer 12 requests from a process in `cg` to `to`;
/// each socket must report the address dialled, not the backend's.
fn backends_answering(cg: &Cgroup, ns: &Netns, agent: &Agent, proto: &str, to: &str) -> Result<BTreeSet<String>> {
    let mut answered = BTreeSet::new();
    for _ in 0..12 {
        let line = probe(cg, ns, proto, to).with_context(|| agent.logs())?;
        assert!(line.starts_with(&format!("peer={to} reply=")), "{proto} {to}: {line}\n{}", agent.logs());
        let backend = line.split("reply=").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or_default();
        answered.insert(backend.to_string());
    }
    Ok(answered)
}

/// connect6 and sendmsg6 pick a backend, getpeername6 and recvmsg6 show the
/// ClusterIP back, and a Service without endpoints is refused. A process
/// outside the agent's cgroup gets the same from TC egress, masqueraded to
/// the node's address, both through the route to the service CIDR and to a
/// NodePort on the node's own address (loopback's egress).
#[test]
#[ignore = "needs root (network namespaces, cgroups and BPF)"]
fn node_processes_reach_ipv6_services_through_the_socket_hooks() -> Result<()> {
    let mut node = Node::new("nodelocal6")?;
    // The node's own IPv6 address: the source its processes reach pods from.
    node.ns.ip(&["addr", "add", "2001:db8::2/128", "dev", "lo", "nodad"])?;
    let b1 = node.add_pod("b1", "fd00:244::11".parse::<Ipv6Addr>()?)?;
    let b2 = node.add_pod("b2", "fd00:244::12".parse::<Ipv6Addr>()?)?;
    let mut servers = Vec::new();
    for p in [&b1, &b2] {
        for port in [8080, 5353] {
            servers.push(EchoServer::start_on(&p.ns, &p.name, SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port))?);
        }
    }
    let cg = Cgroup::new("nodelocal6")?;
    let outside_cg = Cgroup::outside("nodelocal6")?;
    let bpffs = Bpffs::new("nodelocal6")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), MANIFESTS_V6)?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    for (proto, to) in [("tcp", "[fd00:96::10]:80"), ("udp", "[fd00:96::10]:53")] {
        let answered = backends_answering(&cg, &node.ns, &agent, proto, to)?;
        assert_eq!(answered, BTreeSet::from(["b1".to_string(), "b2".to_string()]), "{proto} {to}");
    }
    assert_eq!(probe(&cg, &node.ns, "tcp", "[fd00:96::12]:80")?, refused()?, "no endpoints: REJECT");
    // Where the service CIDR is routed (here via pod b1, as a node routes
    // it via its default gateway), an outside process's packets leave and
    // TC egress translates them: each backend answers, and sees the node.
    node.ns.ip(&["-6", "route", "add", "fd00:96::/112", "via", "fd00:244::11", "dev", &b1.host_if])?;
    for (proto, to) in [
        ("tcp", "[fd00:96::10]:80"),
        ("udp", "[fd00:96::10]:53"),
        ("tcp", "[2001:db8::2]:30080"),
        ("udp", "[2001:db8::2]:30053"),
    ] {
        let answered = backends_answering(&outside_cg, &node.ns, &agent, proto, to)?;
        assert_eq!(answered, BTreeSet::from(["b1".to_string(), "b2".to_string()]), "outside the cgroup: {proto} {to}");
        let line = probe(&outside_cg, &node.ns, proto, to)?;
        assert!(line.contains(" [2001:db8::2]:"), "outside the cgroup: {proto} {to}: the backend saw another source: {line}");
    }
    // TC's REJECT is a real reset on every kernel (the hooks' errno is
    // EPERM before 5.18, see refused()).
    let outside = probe(&outside_cg, &node.ns, "tcp", "[fd00:96::12]:80")?;
    assert_eq!(outside, "error=ConnectionRefused", "outside the cgroup, no endpoints: REJECT");
    // Those were TC's, not the hooks' (which a process outside never passes).
    let scraped = agent.scrape(&node.ns)?;
    let node_egress = scraped.iter().find(|(k, _)| k.contains(r#"reason="node_egress""#)).map(|(_, v)| *v);
    assert!(node_egress.is_some_and(|n| n >= 48.0), "node_egress: {node_egress:?}");
    Ok(())
}

/// Pods under the hooks (their threads share the hooked root with the node's
/// processes here, as their cgroups do on a real node): a pod's own
/// 127.0.0.1:<nodePort> is its own loopback (nothing listens there: refused,
/// where a translated connect would reach a backend), and a pod reaching a
/// NodePort on the node's address is masqueraded, as TC does at its veth.
/// The node's processes are still translated. Run with the node's netns
/// known by SO_NETNS_COOKIE and by the older kernels' probe socket.
#[test]
#[ignore = "needs root (network namespaces, cgroups and BPF)"]
fn pods_under_the_hooks_are_left_to_tc() -> Result<()> {
    for how in ["SO_NETNS_COOKIE", "probe"] {
        pods_left_to_tc(how).with_context(|| format!("node netns learned by {how}"))?;
    }
    Ok(())
}

fn pods_left_to_tc(how: &str) -> Result<()> {
    let mut world = World::new("podhooks")?;
    let client = world.node.add_pod("client", Ipv4Addr::new(10, 244, 0, 20))?;
    let node = &world.node;
    let cg = Cgroup::new("podhooks")?;
    let bpffs = Bpffs::new("podhooks")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), MANIFESTS)?;
    let env = format!("EBPF_PROXY_NETNS_COOKIE={}", if how == "probe" { "probe" } else { "sockopt" });
    let mut agent = Agent::start_wrapped(&node.ns, &["env", &env], dir.path(), &root, &["--cluster-cidr", "10.244.0.0/16"])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    // Without SO_NETNS_COOKIE (before Linux 5.14) the agent probes anyway.
    let learned = if proxy_user::cgroup::has_so_netns_cookie() { how } else { "probe" };
    assert!(agent.logs().contains(&format!("learned_by=\"{learned}\"")), "the agent learned its netns otherwise:\n{}", agent.logs());

    let local = proxy_tests::echo::tcp_request_from(&client.ns, None, "127.0.0.1:30080".parse()?, Duration::from_secs(2));
    match local {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        other => anyhow::bail!("a pod's 127.0.0.1:30080 must stay its own (refused), got {other:?}"),
    }
    let via_node = proxy_tests::echo::tcp_request(&client.ns, SocketAddr::new(NODE_IP.into(), 30080)).with_context(|| agent.logs())?;
    assert!(
        via_node.seen_client.starts_with(&format!("{NODE_IP}:")),
        "pod to NodePort must be masqueraded to the node's address, the backend saw {}",
        via_node.seen_client
    );
    // The ClusterIP from the pod: TC's translation, the pod's own source kept.
    let cluster_ip = proxy_tests::echo::tcp_request(&client.ns, "10.96.0.10:80".parse()?).with_context(|| agent.logs())?;
    assert_eq!((cluster_ip.from.to_string(), cluster_ip.seen_client.split(':').next()), ("10.96.0.10:80".into(), Some("10.244.0.20")));
    let line = probe(&cg, &node.ns, "tcp", "10.96.0.10:80")?;
    assert!(line.starts_with("peer=10.96.0.10:80 reply="), "node process: {line}\n{}", agent.logs());
    Ok(())
}

