//! sessionAffinity ClientIP stays within its Service when the agent reuses
//! IDs (issue 17). The datapath trusts a client's affinity entry (service
//! ID, client -> backend ID) while the backend ID exists; the agent hands
//! freed IDs out again, lowest first. A sticky client that stays quiet
//! while its endpoint is replaced must not follow the freed backend ID to
//! the pod of another Service (in another namespace) that takes it next,
//! nor inherit a deleted Service's entry through its freed service ID.
//! kube-proxy keeps such a client on its own Service's endpoints; so must
//! we. Real sockets, the agent binary, one node. Needs root.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, dump_json, dumped_backends, wait_until},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request_from},
    netns::Netns,
    topology::Node,
};

const TIMEOUT: Duration = Duration::from_secs(10);
const PORT: u16 = 80;
const TARGET: u16 = 8080;
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
/// Connections of the sticky client after the reuse.
const AFTER: usize = 20;

/// Service `namespace/web` on `cluster_ip`:80 -> 8080/TCP, sticky or not,
/// and (if any) an EndpointSlice listing `endpoints`.
fn service(namespace: &str, cluster_ip: Ipv4Addr, sticky: bool, endpoints: &[Ipv4Addr]) -> String {
    let affinity = if sticky { "  sessionAffinity: ClientIP\n" } else { "" };
    let mut text = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: {namespace}}}\nspec:\n  clusterIP: {cluster_ip}\n\
         {affinity}  ports: [{{name: http, port: {PORT}, targetPort: {TARGET}, protocol: TCP}}]\n"
    );
    if !endpoints.is_empty() {
        let list: String = endpoints.iter().map(|ip| format!("- {{addresses: [{ip}], conditions: {{ready: true}}, nodeName: node-a}}\n")).collect();
        text.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-abcde\n  namespace: {namespace}\n  \
             labels: {{kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{{name: http, port: {TARGET}, protocol: TCP}}]\n\
             endpoints:\n{list}"
        ));
    }
    text
}

/// Which backends answered `n` new connections of the client to `vip`:80.
fn connections(client: &Netns, vip: Ipv4Addr, n: usize) -> Result<BTreeMap<String, usize>> {
    let mut seen = BTreeMap::new();
    for i in 0..n {
        let r = tcp_request_from(client, None, SocketAddr::from((vip, PORT)), TIMEOUT).with_context(|| format!("connection {i} to {vip}:{PORT}"))?;
        *seen.entry(r.backend).or_default() += 1;
    }
    Ok(seen)
}

/// Waits until the agent serves `vip`:80 with exactly `endpoints`.
fn wait_applied(agent: &Agent, root: &Path, vip: Ipv4Addr, endpoints: &[Ipv4Addr]) -> Result<()> {
    let mut want: Vec<String> = endpoints.iter().map(|ip| format!("{ip}:{TARGET}")).collect();
    want.sort();
    wait_until(&format!("the agent to serve {vip} with {want:?}"), TIMEOUT, || {
        Ok(dumped_backends(root, &format!("{vip}:{PORT}/TCP")).ok() == Some(want.clone()))
    })
    .with_context(|| agent.logs())
}

/// Waits until no frontend of the agent's is on `vip`.
fn wait_gone(agent: &Agent, root: &Path, vip: Ipv4Addr) -> Result<()> {
    let prefix = format!("{vip}:");
    wait_until(&format!("the agent to drop {vip}"), TIMEOUT, || {
        let rows = dump_json("services", root)?;
        Ok(!rows.as_array().into_iter().flatten().any(|r| r["frontend"].as_str().is_some_and(|f| f.starts_with(&prefix))))
    })
    .with_context(|| agent.logs())
}

/// The sync that freed the ID deleted the client's entry (and so the ID
/// was free for the next sync to hand out).
fn assert_purged(agent: &Agent) {
    let logs = agent.logs();
    assert!(logs.lines().any(|l| l.contains("sync done") && l.contains("affinity_purged=1")), "no sync purged the entry:\n{logs}");
}

fn only(seen: &BTreeMap<String, usize>, backend: &str) -> bool {
    seen.keys().all(|b| b == backend)
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_sticky_client_stays_on_its_service_when_its_backend_id_is_reused() -> Result<()> {
    let (a1_ip, a2_ip, b1_ip) = (Ipv4Addr::new(10, 244, 1, 11), Ipv4Addr::new(10, 244, 1, 12), Ipv4Addr::new(10, 244, 1, 21));
    let (a_vip, b_vip) = (Ipv4Addr::new(10, 96, 0, 20), Ipv4Addr::new(10, 96, 0, 21));
    let mut node = Node::new("affid")?;
    let client = node.add_pod("client", CLIENT)?;
    let (mut pods, mut servers) = (Vec::new(), Vec::new());
    for (name, ip) in [("a1", a1_ip), ("a2", a2_ip), ("b1", b1_ip)] {
        let pod = node.add_pod(name, ip)?;
        servers.push(EchoServer::start(&pod.ns, name, TARGET)?);
        pods.push(pod);
    }

    let bpffs = Bpffs::new("affid")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    let (a_file, b_file) = (manifests.path().join("a.yaml"), manifests.path().join("b.yaml"));
    // a/web: sticky, one endpoint. b/web, another namespace: none yet.
    std::fs::write(&a_file, service("a", a_vip, true, &[a1_ip]))?;
    std::fs::write(&b_file, service("b", b_vip, false, &[]))?;
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let seen = connections(&client.ns, a_vip, 3).with_context(|| agent.logs())?;
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["a1"], "the client sticks to a's only endpoint");

    // The client stays quiet while a1 is replaced by a2 (a1's backend ID is
    // freed), then b gets an endpoint (which takes the lowest free ID).
    std::fs::write(&a_file, service("a", a_vip, true, &[a2_ip]))?;
    wait_applied(&agent, &root, a_vip, &[a2_ip])?;
    std::fs::write(&b_file, service("b", b_vip, false, &[b1_ip]))?;
    wait_applied(&agent, &root, b_vip, &[b1_ip])?;

    let seen = connections(&client.ns, a_vip, AFTER).with_context(|| agent.logs())?;
    assert!(only(&seen, "a2"), "the client's {AFTER} connections to a/web were answered by {seen:?}, want only a2 (a's endpoint)");
    let seen = connections(&client.ns, b_vip, 3).with_context(|| agent.logs())?;
    assert!(only(&seen, "b1"), "b/web answered by {seen:?}");
    assert_purged(&agent);
    drop((servers, pods));
    Ok(())
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn a_sticky_client_inherits_nothing_through_a_reused_service_id() -> Result<()> {
    let (p1_ip, p3_ip) = (Ipv4Addr::new(10, 244, 1, 31), Ipv4Addr::new(10, 244, 1, 33));
    let (a_vip, c_vip, d_vip) = (Ipv4Addr::new(10, 96, 0, 30), Ipv4Addr::new(10, 96, 0, 33), Ipv4Addr::new(10, 96, 0, 32));
    let mut node = Node::new("affsvc")?;
    let client = node.add_pod("client", CLIENT)?;
    let (mut pods, mut servers) = (Vec::new(), Vec::new());
    for (name, ip) in [("p1", p1_ip), ("p3", p3_ip)] {
        let pod = node.add_pod(name, ip)?;
        servers.push(EchoServer::start(&pod.ns, name, TARGET)?);
        pods.push(pod);
    }

    let bpffs = Bpffs::new("affsvc")?;
    let root = bpffs.path().join("agent");
    let manifests = tempfile::tempdir()?;
    let (a_file, c_file, d_file) = (manifests.path().join("a.yaml"), manifests.path().join("c.yaml"), manifests.path().join("d.yaml"));
    // a/web is sticky to p1; d/web lists p1 too, so p1's backend ID lives on.
    std::fs::write(&a_file, service("a", a_vip, true, &[p1_ip]))?;
    std::fs::write(&d_file, service("d", d_vip, false, &[p1_ip]))?;
    let mut agent = Agent::start(&node.ns, manifests.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, TIMEOUT)?;

    let seen = connections(&client.ns, a_vip, 3).with_context(|| agent.logs())?;
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["p1"]);

    // a/web goes (its service ID is freed); c/web, sticky, comes (and takes it).
    std::fs::remove_file(&a_file)?;
    wait_gone(&agent, &root, a_vip)?;
    std::fs::write(&c_file, service("c", c_vip, true, &[p3_ip]))?;
    wait_applied(&agent, &root, c_vip, &[p3_ip])?;

    let seen = connections(&client.ns, c_vip, AFTER).with_context(|| agent.logs())?;
    assert!(only(&seen, "p3"), "the client's {AFTER} connections to c/web were answered by {seen:?}, want only p3 (c's endpoint)");
    assert_purged(&agent);
    drop((servers, pods));
    Ok(())
}
