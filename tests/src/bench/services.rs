//! A synthetic cluster: `count` Services of `ENDPOINTS` endpoints each, with
//! one port: TCP 80 -> 8080 for even indexes, UDP 53 -> 5353 for odd ones.
//! One of them, the probe, has both ports, is of type NodePort and has
//! endpoints that really exist (addresses on a backend pod); the others point at addresses nothing
//! answers on, as in a large cluster where the traffic under test uses one
//! Service among many. The same set becomes manifests for ebpf-proxy, map
//! contents for the micro-benchmark and rule sets for the kube-proxy peers.
//! 100 000 Services make 1 000 010 backends, within the maps' sizes.

use std::{fmt::Write as _, net::Ipv4Addr, path::Path};

use anyhow::{Context, Result};

pub const ENDPOINTS: usize = 10;
pub const TCP_PORT: u16 = 80;
pub const TCP_TARGET: u16 = 8080;
pub const UDP_PORT: u16 = 53;
pub const UDP_TARGET: u16 = 5353;
/// The probe is a NodePort Service: TCP 30080, UDP 30053.
pub const TCP_NODE_PORT: u16 = 30080;
pub const UDP_NODE_PORT: u16 = 30053;

/// ClusterIPs come from 10.96.0.0/12, filler endpoints from 10.128.0.0/10;
/// both hold well over 100 000 Services of 10 endpoints.
const SERVICE_BASE: u32 = u32::from_be_bytes([10, 96, 0, 0]);
const FILLER_BASE: u32 = u32::from_be_bytes([10, 128, 0, 0]);
/// The probe's endpoints: 10.244.1.1 .. 10.244.1.10, all on one backend pod.
const PROBE_BASE: u32 = u32::from_be_bytes([10, 244, 1, 0]);

#[derive(Clone, Debug)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub endpoints: Vec<Ipv4Addr>,
    pub tcp: bool,
    pub udp: bool,
    /// Type NodePort (TCP_NODE_PORT, UDP_NODE_PORT) rather than ClusterIP.
    pub node_port: bool,
}

#[derive(Clone, Debug)]
pub struct ServiceSet {
    pub services: Vec<Service>,
    /// Index of the Service the traffic goes to: the middle one, so the
    /// linear iptables chain is walked halfway on average, not best or worst case.
    pub probe: usize,
}

impl ServiceSet {
    pub fn new(count: usize) -> ServiceSet {
        assert!(count >= 1 && count <= 400_000, "service count {count} outside 1..=400000");
        let probe = count / 2;
        let services = (0..count)
            .map(|i| {
                let endpoints = if i == probe {
                    probe_endpoints()
                } else {
                    (0..ENDPOINTS).map(|j| Ipv4Addr::from(FILLER_BASE + (i * ENDPOINTS + j) as u32 + 1)).collect()
                };
                Service {
                    namespace: format!("bench{}", i / 1000),
                    name: format!("svc{i}"),
                    cluster_ip: cluster_ip(i),
                    endpoints,
                    tcp: i == probe || i % 2 == 0,
                    udp: i == probe || i % 2 == 1,
                    node_port: i == probe,
                }
            })
            .collect();
        ServiceSet { services, probe }
    }

    pub fn probe(&self) -> &Service {
        &self.services[self.probe]
    }

    /// Writes the Services and EndpointSlices as manifests, `per_file` Services
    /// a file, so a later change to one file re-reads only that file.
    pub fn write_manifests(&self, dir: &Path, per_file: usize) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (n, chunk) in self.services.chunks(per_file.max(1)).enumerate() {
            let mut text = String::with_capacity(chunk.len() * 1200);
            for svc in chunk {
                text.push_str(&manifest(svc));
                text.push_str("---\n");
            }
            let path = dir.join(format!("services-{n:04}.yaml"));
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

pub fn cluster_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::from(SERVICE_BASE + index as u32 + 1)
}

pub fn probe_endpoints() -> Vec<Ipv4Addr> {
    (1..=ENDPOINTS as u32).map(|j| Ipv4Addr::from(PROBE_BASE + j)).collect()
}

/// A Service and its EndpointSlice, in the shape the API server returns.
pub fn manifest(svc: &Service) -> String {
    let Service { namespace, name, cluster_ip, .. } = svc;
    let kind = if svc.node_port { "NodePort" } else { "ClusterIP" };
    let mut ports = String::new();
    let mut slice_ports = String::new();
    let node_port = |p: u16| if svc.node_port { format!(", nodePort: {p}") } else { String::new() };
    if svc.tcp {
        let np = node_port(TCP_NODE_PORT);
        let _ = writeln!(ports, "  - {{name: tcp, port: {TCP_PORT}, targetPort: {TCP_TARGET}, protocol: TCP{np}}}");
        let _ = writeln!(slice_ports, "- {{name: tcp, port: {TCP_TARGET}, protocol: TCP}}");
    }
    if svc.udp {
        let np = node_port(UDP_NODE_PORT);
        let _ = writeln!(ports, "  - {{name: udp, port: {UDP_PORT}, targetPort: {UDP_TARGET}, protocol: UDP{np}}}");
        let _ = writeln!(slice_ports, "- {{name: udp, port: {UDP_TARGET}, protocol: UDP}}");
    }
    let mut endpoints = String::new();
    for ip in &svc.endpoints {
        let _ = writeln!(endpoints, "- addresses: [{ip}]\n  conditions: {{ready: true}}\n  nodeName: node-b");
    }
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  type: {kind}
  clusterIP: {cluster_ip}
  ports:
{ports}---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-bench
  namespace: {namespace}
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports:
{slice_ports}endpoints:
{endpoints}"#
    )
}

/// The same Service and EndpointSlice as `manifest`, as the API server's
/// JSON objects (for the fake API server).
pub fn api_objects(svc: &Service) -> (serde_json::Value, serde_json::Value) {
    use serde_json::json;
    let Service { namespace, name, cluster_ip, .. } = svc;
    let mut ports = Vec::new();
    let mut slice_ports = Vec::new();
    for (on, port_name, port, target, proto, node_port) in [
        (svc.tcp, "tcp", TCP_PORT, TCP_TARGET, "TCP", TCP_NODE_PORT),
        (svc.udp, "udp", UDP_PORT, UDP_TARGET, "UDP", UDP_NODE_PORT),
    ] {
        if !on {
            continue;
        }
        let mut p = json!({"name": port_name, "port": port, "targetPort": target, "protocol": proto});
        if svc.node_port {
            p["nodePort"] = json!(node_port);
        }
        ports.push(p);
        slice_ports.push(json!({"name": port_name, "port": target, "protocol": proto}));
    }
    let endpoints: Vec<serde_json::Value> = svc
        .endpoints
        .iter()
        .map(|ip| json!({"addresses": [ip.to_string()], "conditions": {"ready": true}, "nodeName": "node-b"}))
        .collect();
    let service = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": if svc.node_port { "NodePort" } else { "ClusterIP" }, "clusterIP": cluster_ip.to_string(), "ports": ports}});
    let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-bench"), "namespace": namespace, "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4", "ports": slice_ports, "endpoints": endpoints});
    (service, slice)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn addresses_are_distinct_and_the_probe_has_both_ports() {
        let set = ServiceSet::new(1001);
        let ips: BTreeSet<_> = set.services.iter().map(|s| s.cluster_ip).collect();
        assert_eq!(ips.len(), 1001);
        let eps: BTreeSet<_> = set.services.iter().flat_map(|s| s.endpoints.iter().copied()).collect();
        assert_eq!(eps.len(), 1001 * ENDPOINTS);
        let probe = set.probe();
        assert!(probe.tcp && probe.udp);
        assert_eq!(probe.endpoints, probe_endpoints());
        assert_eq!(set.services.iter().filter(|s| s.tcp && s.udp).count(), 1);
    }

    #[test]
    fn manifest_lists_the_ports_and_endpoints() {
        let set = ServiceSet::new(3);
        let text = manifest(set.probe());
        assert!(text.contains("type: NodePort"));
        assert!(text.contains("{name: tcp, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}"));
        assert!(text.contains("{name: udp, port: 53, targetPort: 5353, protocol: UDP, nodePort: 30053}"));
        assert_eq!(text.matches("- addresses: [").count(), ENDPOINTS);
        let filler = manifest(&set.services[0]);
        assert!(filler.contains("protocol: TCP") && !filler.contains("protocol: UDP"));
        assert!(filler.contains("type: ClusterIP") && !filler.contains("nodePort"));
    }

    #[test]
    fn api_objects_match_the_manifest() {
        let set = ServiceSet::new(3);
        let (svc, slice) = api_objects(set.probe());
        assert_eq!(svc["spec"]["ports"][1]["nodePort"], 30053);
        assert_eq!(svc["spec"]["clusterIP"], set.probe().cluster_ip.to_string());
        assert_eq!(slice["metadata"]["labels"]["kubernetes.io/service-name"], set.probe().name);
        assert_eq!(slice["endpoints"].as_array().unwrap().len(), ENDPOINTS);
        let (filler, _) = api_objects(&set.services[0]);
        assert_eq!(filler["spec"]["ports"].as_array().unwrap().len(), 1);
        assert!(filler["spec"]["ports"][0].get("nodePort").is_none());
    }
}
