//! Every kind of frontend with real sockets, on one node: NodePort,
//! ExternalIP and LoadBalancer reached from a host outside the cluster and
//! from a pod, with externalTrafficPolicy Cluster (masqueraded: the backend
//! sees the node) and Local (only the local endpoint, client address kept,
//! pods short-circuited to every endpoint), loadBalancerSourceRanges, REJECT
//! of a Service without endpoints (ECONNREFUSED for TCP and UDP), DROP of an
//! unallocated service-CIDR address, hairpin and ClientIP affinity.
//! Multi-node behaviour is in the conformance suite.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, dump_json, trace_json},
    bpffs::Bpffs,
    echo::{EchoServer, Reply, tcp_request_from, udp_request_connected},
    netns::Netns,
    topology::{External, Node, Pod},
};

const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);
const EXTERNAL: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const EXTERNAL_BLOCKED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 130);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 99, 22);
const LB_IP: Ipv4Addr = Ipv4Addr::new(1, 2, 3, 4);
const TIMEOUT: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(700);
const TRIES: usize = 16;

/// `cluster` (eTP Cluster: NodePort 30080, ExternalIP, LB IP with a source
/// range, ClientIP affinity on a second port), `local` (eTP Local: NodePort
/// 30081), `empty` (no endpoints). Endpoint .11 is on this node, .12 is
/// listed on node-b (it lives in this namespace too: the policy only looks
/// at nodeName).
fn manifests() -> String {
    let slice = |name: &str| {
        format!(
            r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports: [{{name: tcp, port: 8080}}, {{name: udp, port: 5353, protocol: UDP}}, {{name: sticky, port: 8080}}]
endpoints:
- {{addresses: [10.244.0.11], nodeName: node-a}}
- {{addresses: [10.244.0.12], nodeName: node-b}}
"#
        )
    };
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: cluster, namespace: demo}}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  externalIPs: [{EXTERNAL_IP}]
  loadBalancerSourceRanges: [203.0.113.0/25]
  ports:
  - {{name: tcp, port: 80, nodePort: 30080}}
  - {{name: udp, port: 53, protocol: UDP, nodePort: 30053}}
status: {{loadBalancer: {{ingress: [{{ip: {LB_IP}}}]}}}}
{}---
apiVersion: v1
kind: Service
metadata: {{name: local, namespace: demo}}
spec:
  type: NodePort
  externalTrafficPolicy: Local
  clusterIP: 10.96.0.11
  ports: [{{name: tcp, port: 80, nodePort: 30081}}]
{}---
apiVersion: v1
kind: Service
metadata: {{name: sticky, namespace: demo}}
spec:
  clusterIP: 10.96.0.13
  sessionAffinity: ClientIP
  ports: [{{name: sticky, port: 80}}]
{}---
apiVersion: v1
kind: Service
metadata: {{name: empty, namespace: demo}}
spec:
  clusterIP: 10.96.0.12
  ports: [{{name: tcp, port: 80}}, {{name: udp, port: 53, protocol: UDP}}]
"#,
        slice("cluster"),
        slice("local"),
        slice("sticky")
    )
}

struct Seen {
    backends: BTreeSet<String>,
    clients: BTreeSet<String>,
}

/// `TRIES` TCP requests from `ns` (optionally from a given source); every
/// reply must come from `to`. Returns who answered and whom they saw.
fn tcp_many(ns: &Netns, from: Option<Ipv4Addr>, to: SocketAddr) -> Result<Seen> {
    let mut seen = Seen { backends: BTreeSet::new(), clients: BTreeSet::new() };
    for i in 0..TRIES {
        let r: Reply = tcp_request_from(ns, from.map(IpAddr::V4), to, TIMEOUT).with_context(|| format!("request {i} to {to}"))?;
        anyhow::ensure!(r.from == to, "reply from {} instead of {to}", r.from);
        seen.backends.insert(r.backend);
        seen.clients.insert(r.seen_client.rsplit_once(':').map(|(ip, _)| ip.to_string()).unwrap_or(r.seen_client));
    }
    Ok(seen)
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// One node running the agent on `manifests()`: a client pod, backends b1
/// and b2 (TCP 8080 and UDP 5353 echo servers), and a host outside the
/// cluster that reaches the node, the ExternalIP, the LB IP and the
/// service CIDR through it.
struct World {
    agent: Agent,
    root: std::path::PathBuf,
    _dir: tempfile::TempDir,
    _bpffs: Bpffs,
    _servers: Vec<EchoServer>,
    ext: External,
    _b2: Pod,
    b1: Pod,
    pod: Pod,
    _node: Node,
}

fn world(label: &str) -> Result<World> {
    let mut node = Node::new(label)?;
    let pod = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let b1 = node.add_pod("b1", Ipv4Addr::new(10, 244, 0, 11))?;
    let b2 = node.add_pod("b2", Ipv4Addr::new(10, 244, 0, 12))?;
    let ext = node.add_external(
        "ext",
        NODE_IP,
        &[EXTERNAL, EXTERNAL_BLOCKED],
        &["192.168.99.0/24", "1.2.3.4/32", "10.96.0.0/16"],
    )?;
    let mut servers = Vec::new();
    for p in [&b1, &b2] {
        servers.push(EchoServer::start(&p.ns, &p.name, 8080)?);
        servers.push(EchoServer::start(&p.ns, &p.name, 5353)?);
    }
    let bpffs = Bpffs::new(label)?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), manifests())?;
    let flags = ["--cluster-cidr", "10.244.0.0/16", "--service-cidr", "10.96.0.0/16"];
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &flags)?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    Ok(World { agent, root, _dir: dir, _bpffs: bpffs, _servers: servers, ext, _b2: b2, b1, pod, _node: node })
}

impl World {
    /// For failures: the agent's log and the datapath counters.
    fn logs(&self) -> String {
        let counters = proxy_user::maps::Maps::open_pinned(&self.root).and_then(|m| m.read_counters()).map(|c| {
            proxy_common::Counter::ALL.iter().zip(c).filter(|(_, n)| *n > 0).map(|(k, n)| format!("{}={n}", k.name())).collect::<Vec<_>>().join(" ")
        });
        format!("counters: {counters:?}\n{}", self.agent.logs())
    }
}

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

fn both() -> BTreeSet<String> {
    set(&["b1", "b2"])
}

fn node_ip() -> String {
    NODE_IP.to_string()
}

/// externalTrafficPolicy Cluster: any endpoint, the backend sees the node.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn cluster_policy_node_port_external_ip_and_lb_ip_reach_any_endpoint_masqueraded() -> Result<()> {
    let w = world("kindcl")?;
    for (to, what) in [((NODE_IP, 30080), "NodePort"), ((EXTERNAL_IP, 80), "ExternalIP"), ((LB_IP, 80), "LoadBalancer IP")] {
        let seen = tcp_many(&w.ext.ns, Some(EXTERNAL), to.into()).with_context(|| format!("{what}\n{}", w.logs()))?;
        assert_eq!(seen.backends, both(), "{what}: answered by");
        assert_eq!(seen.clients, set(&[&node_ip()]), "{what}: masqueraded to the node address");
    }
    let r = udp_request_connected(&w.ext.ns, (NODE_IP, 30053).into(), TIMEOUT).with_context(|| w.logs())?;
    assert_eq!((r.from, r.seen_client.starts_with(&format!("{NODE_IP}:"))), ((NODE_IP, 30053).into(), true), "UDP NodePort");
    Ok(())
}

/// A pod reaching a Cluster-policy NodePort is masqueraded too (kube-proxy).
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_pod_reaching_a_cluster_policy_node_port_is_masqueraded() -> Result<()> {
    let w = world("kindpnp")?;
    let seen = tcp_many(&w.pod.ns, None, (NODE_IP, 30080).into()).with_context(|| w.logs())?;
    assert_eq!(seen.clients, set(&[&node_ip()]), "pod -> NodePort");
    Ok(())
}

/// loadBalancerSourceRanges: outside the range, dropped (a timeout, not a
/// refusal); the NodePort of the same service is not filtered.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn load_balancer_source_ranges_drop_other_sources_at_the_lb_ip_only() -> Result<()> {
    let w = world("kindlbsr")?;
    let blocked = tcp_request_from(&w.ext.ns, Some(EXTERNAL_BLOCKED.into()), (LB_IP, 80).into(), SHORT);
    assert_eq!(blocked.map_err(|e| e.kind()).err(), Some(ErrorKind::TimedOut), "blocked source to the LB IP");
    tcp_many(&w.ext.ns, Some(EXTERNAL), (LB_IP, 80).into()).context("allowed source to the LB IP")?;
    tcp_many(&w.ext.ns, Some(EXTERNAL_BLOCKED), (NODE_IP, 30080).into()).context("blocked source to the NodePort")?;
    Ok(())
}

/// externalTrafficPolicy Local: only the local endpoint, client address
/// kept; a pod is short-circuited to every endpoint, not masqueraded.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn local_policy_keeps_the_client_address_and_serves_outside_clients_locally_only() -> Result<()> {
    let w = world("kindloc")?;
    let seen = tcp_many(&w.ext.ns, Some(EXTERNAL), (NODE_IP, 30081).into()).with_context(|| w.logs())?;
    assert_eq!((seen.backends, seen.clients), (set(&["b1"]), set(&[&EXTERNAL.to_string()])), "eTP=Local from outside");
    let seen = tcp_many(&w.pod.ns, None, (NODE_IP, 30081).into()).with_context(|| w.logs())?;
    assert_eq!((seen.backends, seen.clients), (both(), set(&["10.244.0.2"])), "eTP=Local from a pod");
    Ok(())
}

/// A ClusterIP from outside the cluster CIDR is masqueraded; from a pod it is not.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_cluster_ip_is_masqueraded_for_outside_clients_only() -> Result<()> {
    let w = world("kindcip")?;
    let seen = tcp_many(&w.ext.ns, Some(EXTERNAL), (CLUSTER_IP, 80).into()).with_context(|| w.logs())?;
    assert_eq!(seen.clients, set(&[&node_ip()]), "external -> ClusterIP");
    let seen = tcp_many(&w.pod.ns, None, (CLUSTER_IP, 80).into()).with_context(|| w.logs())?;
    assert_eq!(seen.clients, set(&["10.244.0.2"]), "pod -> ClusterIP");
    Ok(())
}

/// REJECT: no endpoints, or a port the ClusterIP does not serve.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_service_without_endpoints_and_an_unserved_port_are_refused() -> Result<()> {
    let w = world("kindrej")?;
    let empty = Ipv4Addr::new(10, 96, 0, 12);
    for (to, what) in [((empty, 80), "no endpoints"), ((CLUSTER_IP, 81), "unserved port")] {
        let r = tcp_request_from(&w.pod.ns, None, to.into(), TIMEOUT);
        assert_eq!(r.map_err(|e| e.kind()).err(), Some(ErrorKind::ConnectionRefused), "TCP {what}");
    }
    let r = udp_request_connected(&w.pod.ns, (empty, 53).into(), TIMEOUT);
    assert_eq!(r.map_err(|e| e.kind()).err(), Some(ErrorKind::ConnectionRefused), "UDP no endpoints");
    Ok(())
}

/// DROP: an address of the service CIDR that no Service has.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn an_unallocated_service_cidr_address_is_dropped() -> Result<()> {
    let w = world("kinddrop")?;
    let r = tcp_request_from(&w.pod.ns, None, (Ipv4Addr::new(10, 96, 0, 99), 80).into(), SHORT);
    assert_eq!(r.map_err(|e| e.kind()).err(), Some(ErrorKind::TimedOut), "unallocated ClusterIP");
    Ok(())
}

/// Hairpin: b1 reaching its own Service until it lands on itself, seen as the node.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_backend_reaching_itself_through_its_service_sees_the_node() -> Result<()> {
    let w = world("kindhair")?;
    let hairpin = (0..4 * TRIES)
        .map(|_| tcp_request_from(&w.b1.ns, None, (CLUSTER_IP, 80).into(), TIMEOUT))
        .find_map(|r| r.ok().filter(|r| r.backend == "b1"))
        .context("b1 never reached itself through its Service")?;
    assert!(hairpin.seen_client.starts_with(&format!("{NODE_IP}:")), "hairpin seen as {}", hairpin.seen_client);
    Ok(())
}

/// ClientIP affinity: every connection of one client lands on one backend.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn client_ip_affinity_keeps_a_client_on_one_backend() -> Result<()> {
    let w = world("kindaff")?;
    let seen = tcp_many(&w.pod.ns, None, (Ipv4Addr::new(10, 96, 0, 13), 80).into()).with_context(|| w.logs())?;
    assert_eq!(seen.backends.len(), 1, "sessionAffinity ClientIP: {:?}", seen.backends);
    Ok(())
}

/// dump shows every kind with its scope.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn dump_services_shows_every_kind_with_its_scope() -> Result<()> {
    let w = world("kinddump")?;
    let rows = dump_json("services", &w.root)?;
    let kinds: BTreeSet<(String, String)> = rows
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| (r["type"].as_str().unwrap_or_default().to_string(), r["scope"].as_str().unwrap_or_default().to_string()))
        .collect();
    for kind in ["ClusterIP", "NodePort", "ExternalIP", "LoadBalancer"] {
        for scope in ["internal", "external"] {
            assert!(kinds.contains(&(kind.to_string(), scope.to_string())), "dump services lacks {kind}/{scope}: {rows:#}");
        }
    }
    Ok(())
}

/// trace gives the datapath's verdicts and changes no state.
#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn trace_gives_the_datapaths_verdicts_and_changes_no_state() -> Result<()> {
    let w = world("kindtrc")?;
    let root = &w.root;
    // Flows of its own in conntrack first, for trace to leave alone.
    tcp_many(&w.pod.ns, None, (CLUSTER_IP, 80).into()).with_context(|| w.logs())?;
    tcp_many(&w.ext.ns, Some(EXTERNAL), (NODE_IP, 30080).into()).with_context(|| w.logs())?;
    let conntrack_before = flows(root)?;
    let counters_before = counters(root)?;
    let t = trace_json(root, "10.244.0.2", "10.96.0.10:80/TCP")?;
    assert_eq!((t["verdict"].as_str(), t["type"].as_str(), t["scope"].as_str()), (Some("ACCEPT"), Some("ClusterIP"), Some("internal")), "{t:#}");
    assert_eq!(t["service"], "demo/cluster:tcp");
    assert_eq!(strings(&t["candidates"]), set(&["10.244.0.11:8080", "10.244.0.12:8080"]), "{t:#}");
    assert_eq!(t["masquerade"], false);
    let t = trace_json(root, "203.0.113.2", "192.168.0.2:30080/TCP")?;
    assert_eq!((t["verdict"].as_str(), t["type"].as_str(), t["scope"].as_str()), (Some("ACCEPT"), Some("NodePort"), Some("external")), "{t:#}");
    assert_eq!(t["masquerade"], true, "{t:#}");
    let t = trace_json(root, "203.0.113.2", "192.168.0.2:30081/TCP")?;
    assert_eq!((strings(&t["candidates"]), &t["masquerade"]), (set(&["10.244.0.11:8080"]), &serde_json::json!(false)), "{t:#}");
    for (from, to, verdict, reason) in [
        ("10.244.0.2", "10.96.0.12:80/TCP", "REJECT", "no usable endpoint"),
        ("10.244.0.2", "10.96.0.12:53/UDP", "REJECT", "no usable endpoint"),
        ("10.244.0.2", "10.96.0.10:81/TCP", "REJECT", "does not serve"),
        ("10.244.0.2", "10.96.0.99:80/TCP", "DROP", "unallocated"),
        ("203.0.113.130", "1.2.3.4:80/TCP", "DROP", "loadBalancerSourceRanges"),
        ("10.244.0.2", "10.97.0.1:80/TCP", "PASS", "not a service"),
    ] {
        let t = trace_json(root, from, to)?;
        assert_eq!(t["verdict"], verdict, "{from} -> {to}: {t:#}");
        assert!(t["reason"].as_str().unwrap_or_default().contains(reason), "{from} -> {to}: {t:#}");
    }
    assert_eq!(flows(root)?, conntrack_before, "trace changed conntrack");
    assert_eq!(counters(root)?, counters_before, "trace moved the datapath counters");
    Ok(())
}

/// Conntrack entries without their ages, which move on their own.
fn flows(root: &std::path::Path) -> Result<BTreeSet<String>> {
    let rows = dump_json("conntrack", root)?;
    Ok(rows
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| format!("{} {} -> {} => {}", r["direction"], r["source"], r["destination"], r["translated_to"]))
        .collect())
}

fn strings(v: &serde_json::Value) -> BTreeSet<String> {
    v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_string)).collect()
}

/// The datapath counters, without `passed` and `extension_header`: stray
/// packets on the test's links (ARP, IPv6 neighbour discovery, and the MLD
/// reports, behind a hop-by-hop header, of a world just built) move them at
/// any time.
fn counters(root: &std::path::Path) -> Result<Vec<(&'static str, u64)>> {
    let all = proxy_user::maps::Maps::open_pinned(root)?.read_counters()?;
    let stray = ["passed", "extension_header"];
    Ok(proxy_common::Counter::ALL.iter().map(|c| c.name()).zip(all).filter(|(name, _)| !stray.contains(name)).collect())
}
