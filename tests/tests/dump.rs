//! `ebpf-proxy dump` against maps a running agent filled in a netns: service
//! names, kinds and scopes, backend states (ready, serving, terminating,
//! local), conntrack rows with age and service after real traffic, as a
//! table and as JSON, and the same answers with the agent stopped.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::Output,
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, agent_bin},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request, udp_request},
    is_root,
    topology::Node,
};
use serde_json::{Value, json};

const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const DRAINING_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
/// On this node (the agent runs with --node-name node-a): `local`.
const HERE: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const THERE: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 12);
/// A pod being deleted: terminating, still serving.
const LEAVING: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 13);

/// demo/web: TCP 80 and UDP 53 on a ready local and a ready remote endpoint.
/// demo/draining: TCP 80 whose only endpoint is terminating but still serving.
fn manifests() -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo}}
spec:
  clusterIP: {WEB_IP}
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}
  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: demo, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 5353, protocol: UDP}}
endpoints:
- {{addresses: [{HERE}], conditions: {{ready: true}}, nodeName: node-a}}
- {{addresses: [{THERE}], conditions: {{ready: true}}, nodeName: node-b}}
---
apiVersion: v1
kind: Service
metadata: {{name: draining, namespace: demo}}
spec:
  clusterIP: {DRAINING_IP}
  ports:
  - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: draining-1, namespace: demo, labels: {{kubernetes.io/service-name: draining}}}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
endpoints:
- {{addresses: [{LEAVING}], conditions: {{ready: false, serving: true, terminating: true}}, nodeName: node-b}}
"#
    )
}

fn dump(args: &[&str], root: &Path) -> Result<Output> {
    Ok(std::process::Command::new(agent_bin()).arg("dump").args(args).arg("--bpffs-root").arg(root).output()?)
}

fn dump_ok(args: &[&str], root: &Path) -> Result<String> {
    let out = dump(args, root)?;
    anyhow::ensure!(out.status.success(), "dump {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8(out.stdout)?)
}

fn dump_json(what: &str, root: &Path) -> Result<Value> {
    let text = dump_ok(&[what, "-o", "json"], root)?;
    serde_json::from_str(&text).with_context(|| format!("dump {what} -o json is not JSON:\n{text}"))
}

fn expected_services() -> Value {
    let here = |port: u16| json!({"address": format!("{HERE}:{port}"), "state": ["ready", "serving", "local"]});
    let there = |port: u16| json!({"address": format!("{THERE}:{port}"), "state": ["ready", "serving"]});
    json!([
        {"service": "demo/draining:http", "type": "ClusterIP", "frontend": format!("{DRAINING_IP}:80/TCP"), "scope": "internal",
         "backends": [{"address": format!("{LEAVING}:8080"), "state": ["serving", "terminating"]}]},
        {"service": "demo/web:dns", "type": "ClusterIP", "frontend": format!("{WEB_IP}:53/UDP"), "scope": "internal",
         "backends": [here(5353), there(5353)]},
        {"service": "demo/web:http", "type": "ClusterIP", "frontend": format!("{WEB_IP}:80/TCP"), "scope": "internal",
         "backends": [here(8080), there(8080)]},
    ])
}

/// Backends in a stable order (the dump orders them by slot).
fn sorted_backends(mut services: Value) -> Value {
    for row in services.as_array_mut().into_iter().flatten() {
        if let Some(list) = row["backends"].as_array_mut() {
            list.sort_by_key(|b| b["address"].as_str().unwrap_or_default().to_string());
        }
    }
    services
}

#[test]
fn dump_shows_names_states_and_flows_with_the_agent_running_and_stopped() -> Result<()> {
    assert!(is_root(), "needs root (network namespaces and BPF)");
    let mut node = Node::new("dump")?;
    let client = node.add_pod("client", CLIENT)?;
    let here = node.add_pod("here", HERE)?;
    let there = node.add_pod("there", THERE)?;
    let mut servers = Vec::new();
    for pod in [&here, &there] {
        servers.push(EchoServer::start(&pod.ns, &pod.name, 8080)?);
        servers.push(EchoServer::start(&pod.ns, &pod.name, 5353)?);
    }
    let bpffs = Bpffs::new("dump")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("services.yaml"), manifests())?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &[])?;
    agent.wait_healthy(&node.ns, Duration::from_secs(10))?;

    // services: names, kinds, scopes and backend states, not IDs.
    let services = sorted_backends(dump_json("services", &root)?);
    assert_eq!(services, expected_services(), "dump services -o json");
    let table = dump_ok(&["services"], &root)?;
    for cell in [
        "SERVICE",
        "demo/web:http",
        "demo/web:dns",
        "demo/draining:http",
        "ClusterIP",
        &format!("{WEB_IP}:80/TCP"),
        &format!("{WEB_IP}:53/UDP"),
        "internal",
        &format!("{HERE}:8080 (ready,serving,local)"),
        &format!("{THERE}:5353 (ready,serving)"),
        &format!("{LEAVING}:8080 (serving,terminating)"),
    ] {
        assert!(table.contains(cell), "no `{cell}` in the services table:\n{table}");
    }

    // backends: each with its state and the services using it.
    let backends = dump_json("backends", &root)?;
    let row = |addr: String| backends.as_array().into_iter().flatten().find(|r| r["address"] == addr.as_str()).cloned();
    let b = row(format!("{LEAVING}:8080")).context("no backend LEAVING:8080")?;
    assert_eq!(b["protocol"], "TCP");
    assert_eq!((b["state"].clone(), b["services"].clone()), (json!(["serving", "terminating"]), json!(["demo/draining:http"])), "{b}");
    let b = row(format!("{HERE}:5353")).context("no backend HERE:5353")?;
    assert_eq!((b["protocol"].clone(), b["state"].clone()), (json!("UDP"), json!(["ready", "serving", "local"])));
    let table = dump_ok(&["backends"], &root)?;
    assert!(table.contains("ready,serving,local") && table.contains("demo/web:dns"), "{table}");

    // conntrack after real traffic: both directions, the service, an age.
    let tcp = tcp_request(&client.ns, SocketAddr::from((WEB_IP, 80))).with_context(|| agent.logs())?;
    let udp = udp_request(&client.ns, SocketAddr::from((WEB_IP, 53))).with_context(|| agent.logs())?;
    let flows = dump_json("conntrack", &root)?;
    let rows = flows.as_array().context("conntrack is a list")?;
    for (service, proto, backend) in [("demo/web:http", "TCP", &tcp.backend), ("demo/web:dns", "UDP", &udp.backend)] {
        let backend_ip = if backend == "here" { HERE } else { THERE };
        let original = rows
            .iter()
            .find(|r| r["service"] == service && r["direction"] == "original" && r["protocol"] == proto)
            .with_context(|| format!("no original {proto} flow of {service} in {flows:#}"))?;
        assert!(original["source"].as_str().unwrap().starts_with(&format!("{CLIENT}:")), "{original}");
        assert!(original["translated_to"].as_str().unwrap().starts_with(&format!("{backend_ip}:")), "{original}");
        let reply = rows
            .iter()
            .find(|r| r["service"] == service && r["direction"] == "reply" && r["destination"] == original["source"])
            .with_context(|| format!("no reply {proto} flow of {service} in {flows:#}"))?;
        assert_eq!(reply["source"].as_str().unwrap().split(':').next(), Some(backend_ip.to_string().as_str()));
        for r in [original, reply] {
            let (age, idle) = (r["age_seconds"].as_f64().context("age")?, r["idle_seconds"].as_f64().context("idle")?);
            assert!(age >= 0.0 && idle >= 0.0 && idle <= age, "age {age}, idle {idle}: {r}");
        }
    }
    let table = dump_ok(&["conntrack"], &root)?;
    for cell in ["AGE", "IDLE", "demo/web:http", "demo/web:dns", "original", "reply", &format!("{CLIENT}:")] {
        assert!(table.contains(cell), "no `{cell}` in the conntrack table:\n{table}");
    }

    // The agent stopped: the pins still answer, with the same content.
    let conntrack_before = rows.len();
    agent.stop()?;
    assert_eq!(sorted_backends(dump_json("services", &root)?), expected_services(), "services with the agent stopped");
    assert_eq!(dump_json("backends", &root)?, backends, "backends with the agent stopped");
    let after = dump_json("conntrack", &root)?;
    assert_eq!(after.as_array().map(Vec::len), Some(conntrack_before), "conntrack with the agent stopped");
    proxy_tests::run(agent_bin().to_str().unwrap(), &["cleanup", "--bpffs-root", root.to_str().unwrap()])?;
    Ok(())
}

#[test]
fn dump_without_pinned_maps_says_where_it_looked() -> Result<()> {
    let missing = Path::new("/nonexistent/ebpf-proxy");
    for what in ["services", "backends", "conntrack"] {
        let out = dump(&[what], missing)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "dump {what}: {stderr}");
        assert!(stderr.starts_with("ebpf-proxy: error: ") && stderr.contains("/nonexistent/ebpf-proxy/"), "dump {what}: {stderr}");
        assert!(stderr.contains("--bpffs-root"), "the error names the flag to fix: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        assert!(out.stdout.is_empty());
    }
    Ok(())
}
