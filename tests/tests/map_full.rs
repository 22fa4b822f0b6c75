//! Failure isolation when a BPF map is full, with real traffic: a
//! LoadBalancer Service whose ports x loadBalancerSourceRanges are more
//! than SOURCE_RANGES holds sits beside a normal Service. The big one is
//! left out whole, logged once naming it, the map and its capacity, and
//! counted with reason `map_full`; the normal one answers through its
//! ClusterIP, /healthz stays 200, a Service added later is served too, and
//! the big one is programmed once it shrinks to fit. And
//! `--service-map-entries` sizes those maps: the same Service is refused
//! by smaller ones, an agent restarted with other flags keeps the pinned
//! size, and after `cleanup` the new size holds.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_common::{MAP_SOURCE_RANGES, MAX_SOURCE_RANGES};
use proxy_tests::{
    agent::{Agent, agent_bin, dumped_backends, healthz_status, wait_until},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request},
    manifests::{TCP_PORT, TCP_TARGET, UDP_TARGET, echo_service},
    topology::Node,
};

const ECHO_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const LATER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const BIG_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const TIMEOUT: Duration = Duration::from_secs(10);
/// Source ranges of the big Service: 256 ports x 257 ranges = 65 792
/// SOURCE_RANGES entries, 256 more than the map holds.
const RANGES: usize = 257;
const PORTS: usize = 256;

/// `demo/big`: a LoadBalancer Service with `ports` ports, each guarded by
/// the same `RANGES` loadBalancerSourceRanges; port p0 (1000) has an endpoint.
fn big(ports: usize, backend: Ipv4Addr) -> String {
    let ranges: Vec<String> = (0..RANGES).map(|r| format!("198.18.{}.{}/32", r / 256, r % 256)).collect();
    let ports: Vec<String> = (0..ports).map(|p| format!("  - {{name: p{p}, port: {}, targetPort: {TCP_TARGET}}}\n", 1000 + p)).collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: big, namespace: demo}}\nspec:\n  type: LoadBalancer\n  \
         clusterIP: {BIG_IP}\n  loadBalancerSourceRanges: [{}]\n  ports:\n{}\
         status: {{loadBalancer: {{ingress: [{{ip: 192.0.2.30}}]}}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: big-1, namespace: demo, labels: {{kubernetes.io/service-name: big}}}}\n\
         addressType: IPv4\nports: [{{name: p0, port: {TCP_TARGET}}}]\nendpoints: [{{addresses: [{backend}], nodeName: node-a}}]\n",
        ranges.join(", "),
        ports.concat(),
    )
}

fn get(m: &std::collections::BTreeMap<String, f64>, series: &str) -> Option<f64> {
    m.get(series).copied()
}

/// The log lines that report `demo/big` skipped.
fn skip_lines(logs: &str) -> Vec<String> {
    logs.lines().filter(|l| l.contains("skipped service demo/big:")).map(str::to_string).collect()
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_service_too_big_for_a_map_is_skipped_and_everything_else_served() -> Result<()> {
    assert!((RANGES * PORTS) as u64 > u64::from(MAX_SOURCE_RANGES));
    let mut node = Node::new("full")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let backend = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let _servers =
        [EchoServer::start(&backend.ns, &backend.name, TCP_TARGET)?, EchoServer::start(&backend.ns, &backend.name, UDP_TARGET)?];
    let bpffs = Bpffs::new("full")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", ECHO_IP, &[backend.ip]))?;
    let big_file = manifests.path().join("big.yaml");
    std::fs::write(&big_file, big(PORTS, backend.ip))?;

    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    // Healthy although one Service cannot be programmed.
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    let echo = SocketAddr::from((ECHO_IP, TCP_PORT));
    let r = tcp_request(&client.ns, echo).with_context(|| agent.logs())?;
    assert_eq!(r.from, echo);

    // One line names the Service, the map and its capacity.
    let lines = skip_lines(&agent.logs());
    assert_eq!(lines.len(), 1, "{}", agent.logs());
    let want = format!(
        "skipped service demo/big: needs {} entries in map {MAP_SOURCE_RANGES}, which has no room for them (capacity {MAX_SOURCE_RANGES} entries; map full)",
        RANGES * PORTS
    );
    assert!(lines[0].contains(&want), "{}", lines[0]);
    let m = agent.scrape(&node.ns)?;
    assert_eq!(get(&m, r#"ebpf_proxy_skipped_objects_total{kind="Service",reason="map_full"}"#), Some(1.0), "{m:#?}");
    assert_eq!(get(&m, r#"ebpf_proxy_invalid_objects{kind="Service",reason="map_full"}"#), Some(1.0));
    assert_eq!(get(&m, r#"ebpf_proxy_map_entries{map="SOURCE_RANGES"}"#), Some(0.0), "nothing of it written");
    assert_eq!(get(&m, r#"ebpf_proxy_map_pressure{map="SOURCE_RANGES"}"#), Some(0.0));
    let frontends = get(&m, r#"ebpf_proxy_map_entries{map="FRONTENDS"}"#).context("FRONTENDS entries")?;
    let pressure = get(&m, r#"ebpf_proxy_map_pressure{map="FRONTENDS"}"#).context("FRONTENDS pressure")?;
    assert!(frontends > 0.0 && (pressure - frontends / f64::from(proxy_common::MAX_FRONTENDS)).abs() < 1e-9, "{pressure}");
    // Arrays are full from the start: no pressure for them.
    assert_eq!(get(&m, r#"ebpf_proxy_map_pressure{map="COUNTERS"}"#), None);
    assert!(dumped_backends(&root, &format!("{BIG_IP}:1000/TCP")).is_err(), "the big Service is not half-programmed");

    // A Service added after it (and after it by name) is served.
    std::fs::write(manifests.path().join("later.yaml"), echo_service("demo", "later", LATER_IP, &[backend.ip]))?;
    let later = SocketAddr::from((LATER_IP, TCP_PORT));
    wait_until("the later Service answering", TIMEOUT, || Ok(tcp_request(&client.ns, later)?.from == later)).with_context(|| agent.logs())?;
    assert_eq!(healthz_status(&node.ns, agent.healthz)?, Some(200));
    assert_eq!(skip_lines(&agent.logs()).len(), 1, "logged once, not at every sync");
    let m = agent.scrape(&node.ns)?;
    assert_eq!(get(&m, r#"ebpf_proxy_skipped_objects_total{kind="Service",reason="map_full"}"#), Some(1.0));
    assert_eq!(get(&m, "ebpf_proxy_sync_failures_total"), Some(0.0));

    // Shrunk to fit, it is programmed: it was kept waiting, not dropped.
    std::fs::write(&big_file, big(2, backend.ip))?;
    wait_until("the shrunk Service in the maps", TIMEOUT, || {
        let m = agent.scrape(&node.ns)?;
        Ok(get(&m, r#"ebpf_proxy_map_entries{map="SOURCE_RANGES"}"#) == Some((2 * RANGES) as f64)
            && get(&m, r#"ebpf_proxy_invalid_objects{kind="Service",reason="map_full"}"#).is_none_or(|n| n == 0.0))
    })
    .with_context(|| agent.logs())?;
    assert_eq!(dumped_backends(&root, &format!("{BIG_IP}:1000/TCP"))?, [format!("{}:{TCP_TARGET}", backend.ip)]);
    let r = tcp_request(&client.ns, SocketAddr::from((BIG_IP, 1000))).with_context(|| agent.logs())?;
    assert_eq!(r.backend, "backend-1");
    for vip in [echo, later] {
        assert_eq!(tcp_request(&client.ns, vip)?.from, vip);
    }
    assert_eq!(healthz_status(&node.ns, agent.healthz)?, Some(200));
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn service_map_entries_sizes_the_maps_and_the_pinned_size_stays_until_cleanup() -> Result<()> {
    // 1024 entries: SOURCE_RANGES gets 64, fewer than one port of demo/big needs.
    const SMALL: u32 = 1024;
    let small_ranges = SMALL / proxy_common::SOURCE_RANGES_SHARE;
    let mut node = Node::new("mapsz")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let backend = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let _server = EchoServer::start(&backend.ns, &backend.name, TCP_TARGET)?;
    let bpffs = Bpffs::new("mapsz")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    std::fs::write(manifests.path().join("echo.yaml"), echo_service("demo", "echo", ECHO_IP, &[backend.ip]))?;
    std::fs::write(manifests.path().join("big.yaml"), big(1, backend.ip))?;
    let echo = SocketAddr::from((ECHO_IP, TCP_PORT));
    let big_vip = SocketAddr::from((BIG_IP, 1000));
    let refused = format!(
        "skipped service demo/big: needs {RANGES} entries in map {MAP_SOURCE_RANGES}, which has no room for them \
         (capacity {small_ranges} entries; map full)"
    );
    // Refused by the small maps, the rest served; what each map holds at most is exported.
    let check_small = |agent: &mut Agent| -> Result<()> {
        agent.wait_healthy(&node.ns, TIMEOUT)?;
        assert_eq!(tcp_request(&client.ns, echo).with_context(|| agent.logs())?.from, echo);
        wait_until("demo/big reported", TIMEOUT, || Ok(!skip_lines(&agent.logs()).is_empty()))?;
        let lines = skip_lines(&agent.logs());
        assert!(lines.len() == 1 && lines[0].contains(&refused), "{lines:?}");
        let m = agent.scrape(&node.ns)?;
        assert_eq!(get(&m, r#"ebpf_proxy_map_capacity{map="FRONTENDS"}"#), Some(f64::from(SMALL)));
        assert_eq!(get(&m, r#"ebpf_proxy_map_capacity{map="SOURCE_RANGES"}"#), Some(f64::from(small_ranges)));
        assert_eq!(get(&m, r#"ebpf_proxy_skipped_objects_total{kind="Service",reason="map_full"}"#), Some(1.0));
        assert_eq!(get(&m, "ebpf_proxy_sync_failures_total"), Some(0.0), "admitted against the maps' real size");
        Ok(())
    };

    let size = SMALL.to_string();
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &["--service-map-entries", &size])?;
    check_small(&mut agent)?;
    agent.stop()?;

    // Restarted with the default size: the pinned maps keep theirs, and it says so.
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    check_small(&mut agent)?;
    let logs = agent.logs();
    assert!(
        logs.lines().any(|l| l.contains("keeping the pinned map's size") && l.contains(MAP_SOURCE_RANGES)),
        "{logs}"
    );
    agent.stop()?;

    // After cleanup the default size is created, and demo/big fits.
    let out = node.ns.command(agent_bin().to_str().unwrap()).args(["cleanup", "--bpffs-root"]).arg(&root).output()?;
    anyhow::ensure!(out.status.success(), "cleanup: {}", String::from_utf8_lossy(&out.stderr));
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;
    wait_until("demo/big answering", TIMEOUT, || Ok(tcp_request(&client.ns, big_vip)?.backend == "backend-1")).with_context(|| agent.logs())?;
    let m = agent.scrape(&node.ns)?;
    assert_eq!(get(&m, r#"ebpf_proxy_map_capacity{map="SOURCE_RANGES"}"#), Some(f64::from(MAX_SOURCE_RANGES)));
    assert!(skip_lines(&agent.logs()).is_empty(), "{}", agent.logs());
    Ok(())
}
