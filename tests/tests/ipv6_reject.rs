//! IPv6 REJECT with real traffic: a pod reaching an IPv6 ClusterIP without
//! endpoints gets ECONNREFUSED at once, over TCP (a RST) and UDP (an ICMPv6
//! port unreachable the pod's kernel accepts, checksum included), while an
//! unallocated address of the service CIDR is dropped (a timeout), and a
//! served port still reaches its endpoint; `ebpf-proxy trace` on IPv6
//! addresses says the same.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    io::ErrorKind,
    net::{Ipv6Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, trace_json},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request_from, udp_request_connected},
    topology::Node,
};

const TIMEOUT: Duration = Duration::from_secs(10);
const SHORT: Duration = Duration::from_millis(700);

const MANIFESTS: &str = r#"apiVersion: v1
kind: Service
metadata: {name: web6, namespace: demo}
spec:
  clusterIP: fd00:96::10
  ipFamilies: [IPv6]
  ports: [{name: tcp, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web6-1, namespace: demo, labels: {kubernetes.io/service-name: web6}}
addressType: IPv6
ports: [{name: tcp, port: 8080}]
endpoints:
- {addresses: ["fd00:244::11"]}
---
apiVersion: v1
kind: Service
metadata: {name: empty6, namespace: demo}
spec:
  clusterIP: fd00:96::12
  ipFamilies: [IPv6]
  ports:
  - {name: tcp, port: 80}
  - {name: udp, port: 53, protocol: UDP}
"#;

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn ipv6_service_without_endpoints_is_rejected() -> Result<()> {
    let mut node = Node::new("reject6")?;
    let client = node.add_pod("client", v6("fd00:244::2"))?;
    let backend = node.add_pod("b1", v6("fd00:244::11"))?;
    let _server = EchoServer::start_on(&backend.ns, "b1", SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 8080))?;
    let bpffs = Bpffs::new("reject6")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("svc.yaml"), MANIFESTS)?;
    let flags = ["--cluster-cidr", "fd00:244::/64", "--service-cidr", "fd00:96::/112"];
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &flags)?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let served = tcp_request_from(&client.ns, None, (v6("fd00:96::10"), 80).into(), TIMEOUT).with_context(|| agent.logs())?;
    assert_eq!(served.backend, "b1", "a served port reaches its endpoint");
    let empty = v6("fd00:96::12");
    let r = tcp_request_from(&client.ns, None, (empty, 80).into(), TIMEOUT);
    assert_eq!(r.map_err(|e| e.kind()).err(), Some(ErrorKind::ConnectionRefused), "TCP, no endpoints\n{}", agent.logs());
    let r = udp_request_connected(&client.ns, (empty, 53).into(), TIMEOUT);
    assert_eq!(r.map_err(|e| e.kind()).err(), Some(ErrorKind::ConnectionRefused), "UDP, no endpoints\n{}", agent.logs());
    let r = tcp_request_from(&client.ns, None, (v6("fd00:96::99"), 80).into(), SHORT);
    assert_eq!(r.map_err(|e| e.kind()).err(), Some(ErrorKind::TimedOut), "unallocated ClusterIP: dropped");

    let t = trace_json(&root, "fd00:244::2", "[fd00:96::10]:80/TCP")?;
    assert_eq!((t["verdict"].as_str(), t["type"].as_str(), t["scope"].as_str()), (Some("ACCEPT"), Some("ClusterIP"), Some("internal")), "{t:#}");
    assert_eq!(t["candidates"], serde_json::json!(["[fd00:244::11]:8080"]), "{t:#}");
    for (to, verdict) in [("[fd00:96::12]:80/TCP", "REJECT"), ("[fd00:96::12]:53/UDP", "REJECT"), ("[fd00:96::99]:80/TCP", "DROP")] {
        let t = trace_json(&root, "fd00:244::2", to)?;
        assert_eq!(t["verdict"], verdict, "{to}: {t:#}");
    }
    Ok(())
}
