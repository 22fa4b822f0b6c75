//! The agent binary fed by the Kubernetes API (`--kubeconfig`), against a
//! fake apiserver in the node namespace: the first list programs the
//! ClusterIP, a watch event adds a backend and traffic reaches it, and a
//! Service another proxy owns is left alone.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, wait_until},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request},
    fake_api::FakeApi,
    is_root,
    topology::Node,
};
use serde_json::{Value, json};

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const FOREIGN_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const TIMEOUT: Duration = Duration::from_secs(10);

fn service(name: &str, ip: Ipv4Addr, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "demo", "labels": labels},
           "spec": {"clusterIP": ip.to_string(), "ports": [{"name": "tcp", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
}

fn slice(service: &str, ips: &[Ipv4Addr]) -> Value {
    let endpoints: Vec<Value> = ips.iter().map(|ip| json!({"addresses": [ip.to_string()], "nodeName": "node-a"})).collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("{service}-1"), "namespace": "demo", "labels": {"kubernetes.io/service-name": service}},
           "addressType": "IPv4", "endpoints": endpoints, "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}]})
}

#[test]
fn agent_serves_what_the_kubernetes_api_says() -> Result<()> {
    assert!(is_root(), "needs root (network namespaces and BPF)");
    let mut node = Node::new("kapi")?;
    let client = node.add_pod("client", Ipv4Addr::new(10, 244, 0, 2))?;
    let b1 = node.add_pod("backend-1", Ipv4Addr::new(10, 244, 0, 11))?;
    let b2 = node.add_pod("backend-2", Ipv4Addr::new(10, 244, 0, 12))?;
    let _servers = [EchoServer::start(&b1.ns, &b1.name, 8080)?, EchoServer::start(&b2.ns, &b2.name, 8080)?];

    let api = FakeApi::start(&node.ns)?;
    api.apply("nodes", json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}));
    api.apply("services", service("echo", CLUSTER_IP, json!({})));
    api.apply("endpointslices", slice("echo", &[b1.ip]));
    // Another proxy's Service (and, as the EndpointSlice controller mirrors
    // Service labels, its slice): kube-proxy's selector leaves them out.
    api.apply("services", service("foreign", FOREIGN_IP, json!({"service.kubernetes.io/service-proxy-name": "other"})));
    let mut foreign_slice = slice("foreign", &[b2.ip]);
    foreign_slice["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] = json!("other");
    api.apply("endpointslices", foreign_slice);
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;

    let bpffs = Bpffs::new("kapi")?;
    let root = bpffs.path().join("agent");
    let mut agent = Agent::start_kube(&node.ns, &kubeconfig, &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT).with_context(|| format!("requests: {:?}", api.requests()))?;
    let vip = SocketAddr::from((CLUSTER_IP, 80));
    let r = tcp_request(&client.ns, vip).with_context(|| agent.logs())?;
    assert_eq!(r.backend, "backend-1");

    // A watch event: the second backend joins.
    api.apply("endpointslices", slice("echo", &[b1.ip, b2.ip]));
    let mut seen = BTreeSet::new();
    wait_until("both backends answer", TIMEOUT, || {
        seen.insert(tcp_request(&client.ns, vip)?.backend);
        Ok(seen.len() == 2)
    })
    .with_context(|| agent.logs())?;

    assert!(tcp_request(&client.ns, SocketAddr::from((FOREIGN_IP, 80))).is_err(), "another proxy's Service was programmed");
    let requests = api.requests();
    for r in [
        "list services", "watch services", "list endpointslices", "watch endpointslices", "list nodes", "watch nodes", "get nodes",
        "list servicecidrs", "watch servicecidrs",
    ] {
        assert!(requests.iter().any(|x| x == r), "no {r}: {requests:?}");
    }
    Ok(())
}
