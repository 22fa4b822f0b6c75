//! /metrics with real traffic: map fill against capacity, and the datapath's
//! per-CPU verdict counters, move with the packets sent through a ClusterIP;
//! a Service without endpoints shows up as rejects; a bad
//! object is counted by kind and reason; a slice's change shows in the
//! network programming latency.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, dump_json},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request, udp_request},
    manifests::{TCP_PORT, TCP_TARGET, UDP_PORT, UDP_TARGET, echo_service},
    topology::Node,
};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const TIMEOUT: Duration = Duration::from_secs(10);

const EMPTY_AND_BAD: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: demo}
spec: {clusterIP: 10.96.0.20, ports: [{name: tcp, port: 80, protocol: TCP}]}
---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: demo}
spec: {clusterIP: 10.96.0.21, ports: [{name: a, port: 70000}]}
"#;

fn get(m: &BTreeMap<String, f64>, series: &str) -> Result<f64> {
    m.get(series).copied().with_context(|| format!("no {series} in the scrape: {m:#?}"))
}

/// A node with a client and a backend pod, the echo Service (TCP and UDP)
/// and a Service without endpoints, and the agent healthy on them.
struct World {
    _servers: [EchoServer; 2],
    client: proxy_tests::topology::Pod,
    manifests: tempfile::TempDir,
    root: std::path::PathBuf,
    agent: Agent,
    // Dropped last: the agent and servers run in its namespaces.
    _bpffs: Bpffs,
    node: Node,
}

impl World {
    fn new(name: &str) -> Result<World> {
        let mut node = Node::new(name)?;
        let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
        let backend = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
        let servers =
            [EchoServer::start(&backend.ns, &backend.name, TCP_TARGET)?, EchoServer::start(&backend.ns, &backend.name, UDP_TARGET)?];
        let bpffs = Bpffs::new(name)?;
        let root = bpffs.path().join("agent");
        let manifests = tempfile::tempdir()?;
        std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", CLUSTER_IP, &[backend.ip]))?;
        std::fs::write(manifests.path().join("other.yaml"), EMPTY_AND_BAD)?;
        let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
        agent.wait_healthy(&node.ns, TIMEOUT)?;
        Ok(World { _servers: servers, client, manifests, root, agent, _bpffs: bpffs, node })
    }

    fn scrape(&self) -> Result<BTreeMap<String, f64>> {
        self.agent.scrape(&self.node.ns)
    }
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn scrape_shows_each_maps_capacity_and_what_the_sync_wrote() -> Result<()> {
    let w = World::new("metr-fill")?;
    let m = w.scrape()?;
    // Capacities are the maps' own; entries agree with what `dump` reads and
    // what the sync reports: the backend's TCP and UDP ports.
    assert_eq!(get(&m, r#"ebpf_proxy_map_capacity{map="FRONTENDS"}"#)?, f64::from(proxy_common::MAX_FRONTENDS));
    assert_eq!(get(&m, r#"ebpf_proxy_map_capacity{map="CONNTRACK"}"#)?, f64::from(proxy_common::MAX_CONNTRACK));
    for map in proxy_user::maps::PINNED_MAPS {
        get(&m, &format!(r#"ebpf_proxy_map_entries{{map="{map}"}}"#))?;
        get(&m, &format!(r#"ebpf_proxy_map_capacity{{map="{map}"}}"#))?;
    }
    // An array has every slot from the start.
    assert_eq!(get(&m, r#"ebpf_proxy_map_entries{map="COUNTERS"}"#)?, get(&m, r#"ebpf_proxy_map_capacity{map="COUNTERS"}"#)?);
    // `dump services` shows each frontend once per address, port and protocol
    // (the map may hold one key per source scope).
    let dumped = dump_json("services", &w.root)?.as_array().map_or(0, Vec::len) as f64;
    assert!(dumped >= 3.0, "echo TCP, echo UDP and empty at least");
    let frontends = get(&m, r#"ebpf_proxy_map_entries{map="FRONTENDS"}"#)?;
    assert!(frontends >= dumped, "{frontends} entries, {dumped} dumped");
    assert_eq!(get(&m, "ebpf_proxy_frontends_programmed")?, frontends);
    assert_eq!(get(&m, r#"ebpf_proxy_map_entries{map="BACKENDS"}"#)?, 2.0);
    assert_eq!(get(&m, "ebpf_proxy_endpoints_programmed")?, 2.0);
    assert!(get(&m, "kubeproxy_sync_proxy_rules_duration_seconds_count")? >= 1.0);
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_bad_object_is_counted_by_kind_and_reason() -> Result<()> {
    let w = World::new("metr-bad")?;
    let m = w.scrape()?;
    assert_eq!(get(&m, r#"ebpf_proxy_skipped_objects_total{kind="Service",reason="port_out_of_range"}"#)?, 1.0);
    assert_eq!(get(&m, r#"ebpf_proxy_invalid_objects{kind="Service",reason="port_out_of_range"}"#)?, 1.0);
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn verdicts_and_conntrack_move_with_traffic() -> Result<()> {
    let w = World::new("metr-traffic")?;
    let before = w.scrape()?;
    const FLOWS: usize = 5;
    for i in 0..FLOWS {
        tcp_request(&w.client.ns, SocketAddr::from((CLUSTER_IP, TCP_PORT))).with_context(|| format!("tcp {i}: {}", w.agent.logs()))?;
        udp_request(&w.client.ns, SocketAddr::from((CLUSTER_IP, UDP_PORT))).with_context(|| format!("udp {i}"))?;
    }
    // A connection to the Service without endpoints: rejected, as kube-proxy does.
    let empty = SocketAddr::from((EMPTY_IP, 80));
    let refused = w.client.ns.run(move || TcpStream::connect_timeout(&empty, Duration::from_millis(300)).is_err())?;
    assert!(refused, "a Service without endpoints answered");

    let after = w.scrape()?;
    let moved = |series: &str| -> Result<f64> { Ok(get(&after, series)? - get(&before, series)?) };
    let new_flows = moved(r#"ebpf_proxy_packets_total{verdict="translated",reason="new_flow"}"#)?;
    assert!(new_flows >= (2 * FLOWS) as f64, "{new_flows} new flows for {FLOWS} TCP + {FLOWS} UDP");
    assert!(moved(r#"ebpf_proxy_packets_total{verdict="translated",reason="reply"}"#)? >= (2 * FLOWS) as f64);
    assert!(moved(r#"ebpf_proxy_packets_total{verdict="translated",reason="established"}"#)? > 0.0);
    assert!(moved(r#"ebpf_proxy_packets_total{verdict="rejected",reason="rejected"}"#)? >= 1.0);
    // Each flow holds two conntrack entries (original and reply direction).
    assert!(moved(r#"ebpf_proxy_map_entries{map="CONNTRACK"}"#)? >= (4 * FLOWS) as f64, "{after:#?}");
    assert_eq!(moved(r#"ebpf_proxy_map_entries{map="FRONTENDS"}"#)?, 0.0);
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_changed_slice_is_counted_in_the_programming_latency_once() -> Result<()> {
    let w = World::new("metr-late")?;
    const LATENCY: &str = "kubeproxy_network_programming_duration_seconds_count";
    let counted = get(&w.scrape()?, LATENCY)?;
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    std::fs::write(w.manifests.path().join("late.yaml"), late_service(&now))?;
    let deadline = std::time::Instant::now() + TIMEOUT;
    while get(&w.scrape()?, LATENCY)? == counted {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the change at {now} was not counted: {}", w.agent.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(get(&w.scrape()?, LATENCY)?, counted + 1.0, "counted once");
    Ok(())
}

fn late_service(trigger_time: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: late, namespace: demo}}
spec: {{clusterIP: 10.96.0.30, ports: [{{name: tcp, port: 80, protocol: TCP}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: late-1
  namespace: demo
  labels: {{kubernetes.io/service-name: late}}
  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: '{trigger_time}'}}
addressType: IPv4
ports: [{{name: tcp, port: {TCP_TARGET}, protocol: TCP}}]
endpoints: [{{addresses: [10.244.0.11]}}]
"#
    )
}
