//! Topology-aware routing as kube-proxy does it (pkg/proxy/topology.go):
//! a Service's `trafficDistribution` (PreferClose, PreferSameZone,
//! PreferSameNode) reaches the proxy as hints the EndpointSlice controller
//! writes on each endpoint (`hints.forZones`, `hints.forNodes`); the proxy
//! reads only the hints. Among the ready endpoints of a service port:
//!
//! - every one has a node hint and some are hinted for this node: use those
//!   (PreferSameNode);
//! - else every one has a zone hint and some are hinted for this node's zone
//!   (`topology.kubernetes.io/zone`): use those (PreferSameZone; PreferClose
//!   is its older name);
//! - else: no topology, every ready endpoint.
//!
//! The fallback is decided once, on the hints; it never mixes hinted and
//! unhinted endpoints. It applies to cluster-wide traffic only; Local
//! traffic policies pick this node's endpoints regardless.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Node;

use crate::endpoint_slice::Endpoint;

/// The Node label that names its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// This node's zone; "" when the Node or its label is missing (then zone hints never match).
pub fn node_zone(node: Option<&Node>) -> &str {
    node.and_then(|n| n.metadata.labels.as_ref()).and_then(|l| l.get(ZONE_LABEL)).map_or("", String::as_str)
}

/// An endpoint's topology hints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hints {
    pub zones: BTreeSet<String>,
    pub nodes: BTreeSet<String>,
}

impl Hints {
    pub fn of(ep: &Endpoint) -> Hints {
        let h = ep.hints.as_deref();
        Hints {
            zones: h.and_then(|h| h.for_zones.as_ref()).into_iter().flatten().map(|z| z.name.clone()).collect(),
            nodes: h.and_then(|h| h.for_nodes.as_ref()).into_iter().flatten().map(|n| n.name.clone()).collect(),
        }
    }

    /// The same endpoint listed in several slices: its hints from all of them.
    pub fn merge(&mut self, other: &Hints) {
        self.zones.extend(other.zones.iter().cloned());
        self.nodes.extend(other.nodes.iter().cloned());
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every ready endpoint.
    All,
    PreferSameZone,
    PreferSameNode,
}

/// kube-proxy's topologyModeFromHints, over the hints of the ready endpoints.
pub fn mode<'a>(ready: impl IntoIterator<Item = &'a Hints>, node_name: &str, zone: &str) -> Mode {
    let mut any_ready = false;
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for h in ready {
        any_ready = true;
        if h.nodes.is_empty() {
            all_node_hints = false;
        } else if h.nodes.contains(node_name) {
            for_node = true;
        }
        if h.zones.is_empty() {
            all_zone_hints = false;
        } else if h.zones.contains(zone) {
            for_zone = true;
        }
    }
    if any_ready && all_node_hints && for_node {
        Mode::PreferSameNode
    } else if any_ready && all_zone_hints && for_zone {
        Mode::PreferSameZone
    } else {
        Mode::All
    }
}

/// kube-proxy's availableForTopology: whether an endpoint serves this node in `mode`.
pub fn available(h: &Hints, mode: Mode, node_name: &str, zone: &str) -> bool {
    match mode {
        Mode::All => true,
        Mode::PreferSameNode => h.nodes.contains(node_name),
        Mode::PreferSameZone => h.zones.contains(zone),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (ready, zone hints, node hints) of one endpoint.
    type Ep = (bool, &'static [&'static str], &'static [&'static str]);

    fn hints(zones: &[&str], nodes: &[&str]) -> Hints {
        Hints { zones: zones.iter().map(|s| s.to_string()).collect(), nodes: nodes.iter().map(|s| s.to_string()).collect() }
    }

    /// The cluster endpoints (by index) on node `node-a` in `zone`.
    fn pick(eps: &[Ep], zone: &str) -> Vec<usize> {
        let hs: Vec<Hints> = eps.iter().map(|(_, z, n)| hints(z, n)).collect();
        let m = mode(eps.iter().zip(&hs).filter(|((r, _, _), _)| *r).map(|(_, h)| h), "node-a", zone);
        (0..eps.len()).filter(|&i| eps[i].0 && available(&hs[i], m, "node-a", zone)).collect()
    }

    /// kube-proxy's topology_test.go cases, as they bear on the cluster set.
    #[test]
    fn follows_kube_proxy() {
        let cases: &[(&str, &str, &[Ep], &[usize])] = &[
            ("no hints: every ready endpoint", "zone-a", &[(true, &[], &[]), (true, &[], &[]), (false, &[], &[])], &[0, 1]),
            (
                "PreferClose / PreferSameZone: zone hints, this zone's endpoints",
                "zone-a",
                &[(true, &["zone-a"], &[]), (true, &["zone-b"], &[]), (true, &["zone-c"], &[]), (true, &["zone-a"], &[])],
                &[0, 3],
            ),
            (
                "an endpoint hinted for several zones",
                "zone-b",
                &[(true, &["zone-a", "zone-b"], &[]), (true, &["zone-c"], &[])],
                &[0],
            ),
            (
                "one ready endpoint without a zone hint: hints ignored",
                "zone-a",
                &[(true, &["zone-a"], &[]), (true, &[], &[]), (true, &["zone-b"], &[])],
                &[0, 1, 2],
            ),
            (
                "a not-ready endpoint without hints does not disable them",
                "zone-a",
                &[(true, &["zone-a"], &[]), (false, &[], &[]), (true, &["zone-b"], &[])],
                &[0],
            ),
            ("no endpoint hinted for this zone: hints ignored", "zone-c", &[(true, &["zone-a"], &[]), (true, &["zone-b"], &[])], &[0, 1]),
            ("node without a zone label: zone hints ignored", "", &[(true, &["zone-a"], &[]), (true, &["zone-b"], &[])], &[0, 1]),
            (
                "PreferSameNode: node hints, this node's endpoints",
                "zone-a",
                &[(true, &["zone-a"], &["node-a"]), (true, &["zone-a"], &["node-b"]), (true, &["zone-b"], &["node-c"])],
                &[0],
            ),
            (
                "PreferSameNode with nothing on this node: falls back to the zone",
                "zone-a",
                &[(true, &["zone-a"], &["node-b"]), (true, &["zone-a"], &["node-c"]), (true, &["zone-b"], &["node-d"])],
                &[0, 1],
            ),
            (
                "node hints missing on one endpoint: falls back to the zone",
                "zone-b",
                &[(true, &["zone-a"], &["node-a"]), (true, &["zone-b"], &[]), (true, &["zone-b"], &["node-c"])],
                &[1, 2],
            ),
            (
                "neither node nor zone usable: every ready endpoint",
                "zone-x",
                &[(true, &["zone-a"], &["node-b"]), (true, &["zone-b"], &["node-c"])],
                &[0, 1],
            ),
            ("no ready endpoint: nothing here (the caller falls back to terminating ones)", "zone-a", &[(false, &["zone-a"], &[])], &[]),
        ];
        for (name, zone, eps, want) in cases {
            assert_eq!(pick(eps, zone), *want, "{name}");
        }
    }

    #[test]
    fn reads_hints_and_zone_from_api_objects() {
        let ep: Endpoint = serde_json::from_value(serde_json::json!({
            "addresses": ["10.0.0.1"],
            "hints": {"forZones": [{"name": "zone-a"}], "forNodes": [{"name": "node-a"}]}
        }))
        .unwrap();
        assert_eq!(Hints::of(&ep), hints(&["zone-a"], &["node-a"]));
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a", "labels": {ZONE_LABEL: "zone-a"}}
        }))
        .unwrap();
        assert_eq!(node_zone(Some(&node)), "zone-a");
        assert_eq!(node_zone(None), "");
    }

    /// Through the model: the node's zone label and the slices' hints pick
    /// the ClusterIP's backends; without the Node, hints are ignored.
    #[test]
    fn the_model_routes_cluster_traffic_by_zone() {
        use crate::{
            model::{self, ModelConfig},
            source::Snapshot,
        };
        let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: a}
spec: {clusterIP: 10.96.0.10, trafficDistribution: PreferClose, ports: [{name: http, port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: a, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.1.1], zone: zone-a, hints: {forZones: [{name: zone-a}]}}
- {addresses: [10.244.2.1], zone: zone-b, hints: {forZones: [{name: zone-b}]}}
- {addresses: [10.244.1.2], zone: zone-a, hints: {forZones: [{name: zone-a}]}}
---
apiVersion: v1
kind: Node
metadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}
"#;
        let mut snap = Snapshot::from_yaml(yaml);
        let config = ModelConfig { node_name: "node-a".into(), ..Default::default() };
        let backends = |snap: &Snapshot| -> Vec<String> {
            let (state, errors) = model::build(snap, &config);
            assert!(errors.is_empty(), "{errors:?}");
            state.backend_sets.values().flatten().map(|b| b.addr.to_string()).collect()
        };
        assert_eq!(backends(&snap), ["10.244.1.1", "10.244.1.2"]);
        snap.node = None;
        assert_eq!(backends(&snap), ["10.244.1.1", "10.244.1.2", "10.244.2.1"]);
    }
}
