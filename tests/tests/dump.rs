//! `ebpf-proxy dump` against maps a running agent filled in a netns: service
//! names, kinds (ClusterIP, NodePort, ExternalIP), scopes and endpoint
//! policies, masquerade, REJECT for a service without endpoints, backend
//! states (ready, serving, terminating, local), conntrack rows with age and service after real traffic, as a
//! table and as JSON, and the same answers with the agent stopped.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::Output,
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_tests::{
    agent::{Agent, agent_bin, wait_until},
    bpffs::Bpffs,
    echo::{EchoServer, tcp_request, udp_request},
    topology::Node,
};
use serde_json::{Value, json};

const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const LOCAL_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const DRAINING_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
/// The node's own address (NodePorts open on it) and an externalIP.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 100);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
/// On this node (the agent runs with --node-name node-a): `local`.
const HERE: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
const THERE: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 12);
/// A pod being deleted: terminating, still serving.
const LEAVING: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 13);

fn service(name: &str, ip: Ipv4Addr, spec: &str, ports: &str, endpoints: &[String]) -> String {
    let endpoints: String = endpoints.iter().map(|e| format!("- {e}\n")).collect();
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec:
  clusterIP: {ip}
{spec}  ports:
{ports}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
- {{name: dns, port: 5353, protocol: UDP}}
endpoints:{}
{endpoints}---
"#,
        if endpoints.is_empty() { " []" } else { "" }
    )
}

/// demo/web: NodePort with an externalIP, TCP 80 and UDP 53, on a ready
/// local and a ready remote endpoint. demo/local: the same endpoints with
/// externalTrafficPolicy Local. demo/draining: its only endpoint is
/// terminating but still serving. demo/empty: no endpoint at all.
fn manifests() -> String {
    let ready = |ip: Ipv4Addr, node: &str| format!("{{addresses: [{ip}], conditions: {{ready: true}}, nodeName: {node}}}");
    let both = [ready(HERE, "node-a"), ready(THERE, "node-b")];
    let http = "  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: NODEPORT}\n";
    [
        service(
            "web",
            WEB_IP,
            &format!("  type: NodePort\n  externalIPs: [{EXTERNAL_IP}]\n"),
            &format!("{}  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP}}\n", http.replace("NODEPORT", "30080")),
            &both,
        ),
        service("local", LOCAL_IP, "  type: NodePort\n  externalTrafficPolicy: Local\n", &http.replace("NODEPORT", "30081"), &both),
        service(
            "draining",
            DRAINING_IP,
            "",
            "  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n",
            &[format!("{{addresses: [{LEAVING}], conditions: {{ready: false, serving: true, terminating: true}}, nodeName: node-b}}")],
        ),
        service("empty", EMPTY_IP, "", "  - {name: http, port: 80, targetPort: 8080, protocol: TCP}\n", &[]),
    ]
    .concat()
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

fn backend(ip: Ipv4Addr, port: u16, state: &[&str]) -> Value {
    json!({"address": format!("{ip}:{port}"), "state": state})
}

/// The rows `dump services -o json` must hold (and no other), keyed by
/// service, frontend and scope.
fn expected_services() -> Vec<Value> {
    let web = |port: u16| vec![backend(HERE, port, &["ready", "serving", "local"]), backend(THERE, port, &["ready", "serving"])];
    let row = |service: &str, kind: &str, frontend: String, scope: &str, policy: &str, masquerade: bool, backends: Vec<Value>| {
        json!({"service": service, "type": kind, "frontend": frontend, "scope": scope, "policy": policy,
               "masquerade": masquerade, "source_ranges": false, "affinity_timeout_seconds": 0, "algorithm": "random",
               "if_no_backends": "REJECT", "backends": backends})
    };
    let mut rows = Vec::new();
    for scope in ["internal", "external"] {
        // Sources outside --cluster-cidr reaching a ClusterIP are masqueraded.
        let outside = scope == "external";
        rows.push(row("demo/web:http", "ClusterIP", format!("{WEB_IP}:80/TCP"), scope, "Cluster", outside, web(8080)));
        rows.push(row("demo/web:dns", "ClusterIP", format!("{WEB_IP}:53/UDP"), scope, "Cluster", outside, web(5353)));
        // externalTrafficPolicy Cluster masquerades every source.
        rows.push(row("demo/web:http", "NodePort", format!("{NODE_IP}:30080/TCP"), scope, "Cluster", true, web(8080)));
        rows.push(row("demo/web:http", "ExternalIP", format!("{EXTERNAL_IP}:80/TCP"), scope, "Cluster", true, web(8080)));
        rows.push(row("demo/web:dns", "ExternalIP", format!("{EXTERNAL_IP}:53/UDP"), scope, "Cluster", true, web(5353)));
        rows.push(row("demo/local:http", "ClusterIP", format!("{LOCAL_IP}:80/TCP"), scope, "Cluster", outside, web(8080)));
        rows.push(row("demo/draining:http", "ClusterIP", format!("{DRAINING_IP}:80/TCP"), scope, "Cluster", outside,
            vec![backend(LEAVING, 8080, &["serving", "terminating"])]));
        rows.push(row("demo/empty:http", "ClusterIP", format!("{EMPTY_IP}:80/TCP"), scope, "Cluster", outside, vec![]));
    }
    // externalTrafficPolicy Local: external clients keep their address and
    // reach only this node's endpoint; pods get the cluster-wide set.
    rows.push(row("demo/local:http", "NodePort", format!("{NODE_IP}:30081/TCP"), "external", "Local", false,
        vec![backend(HERE, 8080, &["ready", "serving", "local"])]));
    rows.push(row("demo/local:http", "NodePort", format!("{NODE_IP}:30081/TCP"), "internal", "Cluster", false, web(8080)));
    // NodePorts on 127.0.0.1, for the node's own processes only (internal),
    // which get every endpoint even with externalTrafficPolicy Local.
    rows.push(row("demo/web:http", "NodePort", "127.0.0.1:30080/TCP".into(), "internal", "Cluster", true, web(8080)));
    rows.push(row("demo/local:http", "NodePort", "127.0.0.1:30081/TCP".into(), "internal", "Cluster", false, web(8080)));
    rows
}

fn row_key(r: &Value) -> String {
    format!("{} {} {}", r["service"], r["frontend"], r["scope"])
}

/// Rows by key, backends in a stable order (the dump orders them by slot).
fn by_key(rows: &Value) -> std::collections::BTreeMap<String, Value> {
    rows.as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            let mut r = r.clone();
            if let Some(list) = r["backends"].as_array_mut() {
                list.sort_by_key(|b| b["address"].as_str().unwrap_or_default().to_string());
            }
            (row_key(&r), r)
        })
        .collect()
}

fn assert_services(dumped: &Value, when: &str) {
    let got = by_key(dumped);
    let want = by_key(&Value::Array(expected_services()));
    for (key, row) in &want {
        assert_eq!(got.get(key), Some(row), "{when}: row {key}");
    }
    let extra: Vec<&String> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(extra.is_empty(), "{when}: unexpected rows {extra:?}");
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn dump_shows_names_states_and_flows_with_the_agent_running_and_stopped() -> Result<()> {
    let mut node = Node::new("dump")?;
    let client = node.add_pod("client", CLIENT)?;
    let here = node.add_pod("here", HERE)?;
    let there = node.add_pod("there", THERE)?;
    let mut servers = Vec::new();
    for pod in [&here, &there] {
        servers.push(EchoServer::start(&pod.ns, &pod.name, 8080)?);
        servers.push(EchoServer::start(&pod.ns, &pod.name, 5353)?);
    }
    // The node's own address, where NodePorts open (a veth: no dummy module here).
    node.ns.ip(&["link", "add", "ext0", "type", "veth", "peer", "name", "ext1"])?;
    node.ns.ip(&["addr", "add", &format!("{NODE_IP}/24"), "dev", "ext0"])?;
    node.ns.ip(&["link", "set", "ext0", "up"])?;
    node.ns.ip(&["link", "set", "ext1", "up"])?;
    let bpffs = Bpffs::new("dump")?;
    let root = bpffs.path().join("agent");
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("services.yaml"), manifests())?;
    let mut agent = Agent::start(&node.ns, dir.path(), &root, &["--cluster-cidr", "10.244.0.0/16"])?;
    agent.wait_healthy(&node.ns, Duration::from_secs(10))?;

    // services: names, kinds, scopes, policies and backend states, not IDs.
    // NodePort rows appear once the agent has seen the node's address.
    wait_until("NodePort frontends on the node address", Duration::from_secs(10), || {
        Ok(dump_ok(&["services"], &root)?.contains(&format!("{NODE_IP}:30080/TCP")))
    })?;
    let services = dump_json("services", &root)?;
    assert_services(&services, "agent running");
    let table = dump_ok(&["services"], &root)?;
    for cell in [
        "SERVICE",
        "POLICY",
        "demo/web:http",
        "demo/web:dns",
        "demo/draining:http",
        "ClusterIP",
        "NodePort",
        "ExternalIP",
        &format!("{WEB_IP}:80/TCP"),
        &format!("{WEB_IP}:53/UDP"),
        &format!("{NODE_IP}:30081/TCP"),
        "internal",
        "external",
        "Local",
        "masquerade",
        "(none: REJECT)",
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
            // Answered: out of the table a flood of new flows turns over.
            assert_eq!(r["state"], "confirmed", "{r}");
        }
    }
    for r in rows.iter().filter(|r| r["service"] == "demo/web:http" || r["service"] == "demo/web:dns") {
        assert_eq!(r["masquerade"], false, "a pod inside --cluster-cidr is not masqueraded: {r}");
    }

    // Through the NodePort (externalTrafficPolicy Cluster): masqueraded, and
    // the reply entry names the client the reply goes back to.
    let nodeport = SocketAddr::from((NODE_IP, 30080));
    tcp_request(&client.ns, nodeport).with_context(|| agent.logs())?;
    let masqueraded = |rows: &Value| {
        rows.as_array()
            .into_iter()
            .flatten()
            .find(|r| r["direction"] == "original" && r["destination"] == nodeport.to_string())
            .cloned()
    };
    wait_until("the NodePort flow in conntrack", Duration::from_secs(5), || Ok(masqueraded(&dump_json("conntrack", &root)?).is_some()))?;
    let flows = dump_json("conntrack", &root)?;
    let rows = flows.as_array().context("conntrack is a list")?;
    let original = &masqueraded(&flows).context("NodePort flow gone")?;
    assert_eq!((original["masquerade"].clone(), original["service"].clone()), (json!(true), json!("demo/web:http")), "{original}");
    let reply = rows
        .iter()
        .find(|r| r["direction"] == "reply" && r["client"] == original["source"])
        .with_context(|| format!("no masqueraded reply entry back to {} in {flows:#}", original["source"]))?;
    assert_eq!(reply["masquerade"], true, "{reply}");
    assert_eq!(reply["translated_to"], format!("{NODE_IP}:30080"), "{reply}");
    // The source masquerade chose, kept in the flow's own entry too (XDP
    // reads it there): the address the reply comes back to.
    let source = original["masquerade_source"].as_str().with_context(|| format!("no masquerade source: {original}"))?;
    assert_eq!(json!(source), reply["destination"], "{original}\n{reply}");
    assert!(source.starts_with(&format!("{NODE_IP}:")), "{original}");

    let table = dump_ok(&["conntrack"], &root)?;
    for cell in ["AGE", "IDLE", "MASQ", "STATE", "confirmed", "demo/web:http", "demo/web:dns", "original", "reply", &format!("{CLIENT}:"), "to client", &format!("from {source}"), "yes"] {
        assert!(table.contains(cell), "no `{cell}` in the conntrack table:\n{table}");
    }
    // Masquerade's ports: the NodePort flow's.
    assert!(table.contains("masquerade ports held: 1 by confirmed flows, 0 by unconfirmed ones; out of ports: 0 shared, 0 failed"), "{table}");

    // The agent stopped: the pins still answer, with the same content.
    let conntrack_before = rows.len();
    agent.stop()?;
    assert_services(&dump_json("services", &root)?, "agent stopped");
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
