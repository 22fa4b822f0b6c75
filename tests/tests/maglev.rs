//! Maglev across nodes: two agents (two nodes, each its own namespace and
//! bpffs) fed the same Maglev Service, with the same seed and table size,
//! pick the same backend for every 5-tuple, although they gave the backends
//! different IDs (node B serves another Service whose backends took the
//! low IDs first). After one backend is removed from both, flows on the
//! other backends keep theirs and the removed backend's flows move, on both
//! nodes alike. What each agent picks is read with `ebpf-proxy trace` (the
//! real program on a synthetic packet, against that agent's maps), and
//! checked against the table the pure function builds.

#![feature(custom_test_frameworks)]
#![test_runner(proxy_tests::harness::run)]

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context, Result};
use proxy_common::{Addr, CtKey, IPPROTO_TCP, maglev};
use proxy_tests::{
    agent::{Agent, dump_json, dumped_backends, trace_json, wait_until},
    bpffs::Bpffs,
    topology::Node,
};
use proxy_user::maglev::MaglevParams;

const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const FRONTEND: &str = "10.96.0.50:80/TCP";
const TARGET_PORT: u16 = 8080;
const SEED: u32 = 0x1234_abcd;
const TABLE_SIZE: u32 = 4093;
const TIMEOUT: Duration = Duration::from_secs(20);

fn backend(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 1, 10 + i)
}

/// The Maglev Service with `backends`; with `other`, a second Service whose
/// endpoints sort first, so they take the lowest backend IDs on that node.
fn manifests(backends: &[Ipv4Addr], other: bool) -> String {
    let endpoints: String = backends.iter().map(|ip| format!("- {{addresses: [{ip}], conditions: {{ready: true}}}}\n")).collect();
    let mut yaml = format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo, annotations: {{ebpf-proxy.io/lb-algorithm: maglev}}}}
spec:
  clusterIP: {CLUSTER_IP}
  ports: [{{name: http, port: 80, targetPort: {TARGET_PORT}}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: web-1, namespace: demo, labels: {{kubernetes.io/service-name: web}}}}
addressType: IPv4
ports: [{{name: http, port: {TARGET_PORT}}}]
endpoints:
{endpoints}"#
    );
    if other {
        yaml.push_str(
            r#"---
apiVersion: v1
kind: Service
metadata: {name: other, namespace: demo}
spec:
  clusterIP: 10.96.0.51
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: other-1, namespace: demo, labels: {kubernetes.io/service-name: other}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.0.1]}
- {addresses: [10.244.0.2]}
- {addresses: [10.244.0.3]}
"#,
        );
    }
    yaml
}

/// One node: its namespace, bpffs, manifests directory and agent.
struct NodeUnderTest {
    _node: Node,
    _bpffs: Bpffs,
    root: PathBuf,
    manifests: tempfile::TempDir,
    other: bool,
    agent: Agent,
}

impl NodeUnderTest {
    fn start(label: &str, backends: &[Ipv4Addr], other: bool) -> Result<NodeUnderTest> {
        let node = Node::new(label)?;
        let bpffs = Bpffs::new(label)?;
        let root = bpffs.path().join("agent");
        let manifests = tempfile::tempdir()?;
        std::fs::write(manifests.path().join("svc.yaml"), self::manifests(backends, other))?;
        let seed = format!("{SEED:#x}");
        let size = TABLE_SIZE.to_string();
        let extra = ["--maglev-seed", seed.as_str(), "--maglev-table-size", size.as_str()];
        let mut agent = Agent::start(&node.ns, manifests.path(), &root, &extra)?;
        agent.wait_healthy(&node.ns, TIMEOUT)?;
        Ok(NodeUnderTest { _node: node, _bpffs: bpffs, root, manifests, other, agent })
    }

    /// Replaces the Service's endpoints (a new file renamed in: one change).
    fn set_backends(&self, backends: &[Ipv4Addr]) -> Result<()> {
        let tmp = self.manifests.path().join(".svc.yaml.tmp");
        std::fs::write(&tmp, manifests(backends, self.other))?;
        std::fs::rename(&tmp, self.manifests.path().join("svc.yaml"))?;
        let want: Vec<String> = backends.iter().map(|ip| format!("{ip}:{TARGET_PORT}")).collect();
        let mut want = want;
        want.sort();
        wait_until("the agent to apply the change", TIMEOUT, || Ok(dumped_backends(&self.root, FRONTEND)? == want))
            .with_context(|| self.agent.logs())
    }

    /// The backend and Maglev cell `trace` reports for a new flow.
    fn pick(&self, from: &str) -> Result<(String, u64)> {
        let t = trace_json(&self.root, from, FRONTEND)?;
        anyhow::ensure!(t["verdict"] == "ACCEPT" && t["algorithm"] == "maglev", "trace {from}: {t:#}\n{}", self.agent.logs());
        let backend = t["backend"].as_str().with_context(|| format!("trace {from}: no backend: {t:#}"))?;
        let cell = t["maglev_cell"].as_u64().with_context(|| format!("trace {from}: no Maglev cell: {t:#}"))?;
        anyhow::ensure!(t["maglev_table_size"] == TABLE_SIZE, "trace {from}: table size {}", t["maglev_table_size"]);
        Ok((backend.to_string(), cell))
    }

    /// Each backend's ID on this node.
    fn backend_ids(&self) -> Result<BTreeMap<String, u64>> {
        let rows = dump_json("backends", &self.root)?;
        Ok(rows.as_array().into_iter().flatten().filter_map(|r| Some((r["address"].as_str()?.to_string(), r["id"].as_u64()?))).collect())
    }
}

/// The clients: several addresses, several ports each.
fn clients() -> Vec<(Ipv4Addr, u16)> {
    (0..48u16).map(|i| (Ipv4Addr::new(203, 0, 113, 1 + (i % 6) as u8), 40_000 + i * 131)).collect()
}

/// Where the pure function (`proxy_user::maglev`) sends a client, with `backends`.
fn expected(backends: &[Ipv4Addr], client: (Ipv4Addr, u16)) -> (String, u64) {
    let params = MaglevParams::new(SEED, TABLE_SIZE).unwrap();
    let members: Vec<_> =
        backends.iter().map(|ip| ((IpAddr::V4(*ip), TARGET_PORT, IPPROTO_TCP), format!("{ip}:{TARGET_PORT}"))).collect();
    let cells = params.cells(&members);
    let flow = CtKey {
        src: Addr::from(IpAddr::V4(client.0)),
        dst: Addr::from(IpAddr::V4(CLUSTER_IP)),
        sport: client.1.to_be(),
        dport: 80u16.to_be(),
        proto: IPPROTO_TCP,
        _pad: [0; 3],
    };
    let cell = maglev::flow_hash(&flow, flow.sport, SEED) % TABLE_SIZE;
    (cells[cell as usize].clone(), u64::from(cell))
}

/// Every client's pick on both nodes: equal, and as the pure table says.
fn picks(a: &NodeUnderTest, b: &NodeUnderTest, backends: &[Ipv4Addr]) -> Result<BTreeMap<(Ipv4Addr, u16), String>> {
    let mut picks = BTreeMap::new();
    for client in clients() {
        let from = format!("{}:{}", client.0, client.1);
        let on_a = a.pick(&from)?;
        let on_b = b.pick(&from)?;
        anyhow::ensure!(on_a == on_b, "{from}: node A picks {on_a:?}, node B {on_b:?}: the nodes disagree");
        let want = expected(backends, client);
        anyhow::ensure!(on_a == want, "{from}: the nodes pick {on_a:?}, the Maglev table says {want:?}");
        picks.insert(client, on_a.0);
    }
    Ok(picks)
}

#[test]
#[ignore = "needs root (network namespaces and BPF)"]
fn two_nodes_pick_alike_and_keep_flows_when_a_backend_goes() -> Result<()> {
    let all: Vec<Ipv4Addr> = (1..=5).map(backend).collect();
    let a = NodeUnderTest::start("mglv-a", &all, false)?;
    let b = NodeUnderTest::start("mglv-b", &all, true)?;

    // The same backends, other IDs: the table may not follow them.
    let (ids_a, ids_b) = (a.backend_ids()?, b.backend_ids()?);
    let web = |ids: &BTreeMap<String, u64>| all.iter().map(|ip| ids[&format!("{ip}:{TARGET_PORT}")]).collect::<Vec<_>>();
    assert_ne!(web(&ids_a), web(&ids_b), "the test needs the nodes to number the backends differently");

    // `dump services` names the algorithm of the Service's frontends.
    for n in [&a, &b] {
        let rows = dump_json("services", &n.root)?;
        let algorithms: Vec<&serde_json::Value> =
            rows.as_array().into_iter().flatten().filter(|r| r["frontend"] == FRONTEND).map(|r| &r["algorithm"]).collect();
        assert_eq!(algorithms, ["maglev", "maglev"], "both scopes of {FRONTEND}");
    }

    let before = picks(&a, &b, &all)?;
    let used: std::collections::BTreeSet<&String> = before.values().collect();
    assert!(used.len() >= 4, "48 flows over 5 backends used only {used:?}");

    // A backend in the middle of the canonical order goes, on both nodes
    // (so a table that followed positions rather than identities would
    // move the flows of the backends after it).
    let gone = format!("{}:{TARGET_PORT}", backend(2));
    assert!(before.values().any(|b| *b == gone), "no flow on {gone} to move: {before:?}");
    let rest: Vec<Ipv4Addr> = all.iter().copied().filter(|ip| *ip != backend(2)).collect();
    a.set_backends(&rest)?;
    b.set_backends(&rest)?;

    let after = picks(&a, &b, &rest)?;
    let mut kept = 0;
    for (client, was) in &before {
        let now = &after[client];
        if *was == gone {
            assert_ne!(*now, gone, "{client:?} still goes to the removed backend");
        } else {
            assert_eq!(now, was, "{client:?} was on {was}, which stayed, and moved to {now}");
            kept += 1;
        }
    }
    assert!(kept > 0 && kept < before.len(), "{kept} of {} flows were on the other backends", before.len());
    Ok(())
}
