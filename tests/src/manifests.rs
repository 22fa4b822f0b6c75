//! Sample Kubernetes objects for the demo and the tests.

use std::net::{IpAddr, Ipv4Addr};

pub const TCP_PORT: u16 = 80;
pub const TCP_TARGET: u16 = 8080;
pub const UDP_PORT: u16 = 53;
pub const UDP_TARGET: u16 = 5353;

/// A Service `namespace/name` with a TCP port (80 -> 8080) and a UDP port
/// (53 -> 5353, a named targetPort), and one EndpointSlice listing `backends`.
pub fn echo_service(namespace: &str, name: &str, cluster_ip: Ipv4Addr, backends: &[Ipv4Addr]) -> String {
    let endpoints: String = backends
        .iter()
        .map(|ip| format!("- addresses: [{ip}]\n  conditions: {{ready: true}}\n  nodeName: node-a\n"))
        .collect();
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  type: ClusterIP
  clusterIP: {cluster_ip}
  ports:
  - {{name: tcp, port: {TCP_PORT}, targetPort: {TCP_TARGET}, protocol: TCP}}
  - {{name: udp, port: {UDP_PORT}, targetPort: dns, protocol: UDP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-abcde
  namespace: {namespace}
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports:
- {{name: tcp, port: {TCP_TARGET}, protocol: TCP}}
- {{name: udp, port: {UDP_TARGET}, protocol: UDP}}
endpoints:
{endpoints}"#
    )
}

/// `echo_service` as a NodePort: TCP on `tcp_node_port`, UDP on `udp_node_port`.
pub fn echo_node_port_service(
    cluster_ip: Ipv4Addr,
    backends: &[Ipv4Addr],
    tcp_node_port: u16,
    udp_node_port: u16,
) -> String {
    echo_service("demo", "echo", cluster_ip, backends)
        .replace("type: ClusterIP", "type: NodePort")
        .replace(
            &format!("targetPort: {TCP_TARGET}, protocol: TCP}}"),
            &format!("targetPort: {TCP_TARGET}, nodePort: {tcp_node_port}, protocol: TCP}}"),
        )
        .replace("targetPort: dns, protocol: UDP}", &format!("targetPort: dns, nodePort: {udp_node_port}, protocol: UDP}}"))
}

/// The SCTP tests' Service `tel/sig`: a NodePort on `port` (nodePort
/// `node_port`) whose targetPort differs, so every packet's CRC32c is
/// patched, with one endpoint on node-a.
pub fn sctp_service(cluster_ip: Ipv4Addr, port: u16, target: u16, node_port: u16, backend: Ipv4Addr) -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: sig, namespace: tel}}
spec:
  type: NodePort
  clusterIP: {cluster_ip}
  ports:
  - {{name: m3ua, port: {port}, targetPort: {target}, nodePort: {node_port}, protocol: SCTP}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: sig-abcde
  namespace: tel
  labels: {{kubernetes.io/service-name: sig}}
addressType: IPv4
ports:
- {{name: m3ua, port: {target}, protocol: SCTP}}
endpoints:
- addresses: [{backend}]
  conditions: {{ready: true}}
  nodeName: node-a
"#
    )
}

/// A single-stack Service `demo/NAME` on `vip`: `port`/`proto` to `target`
/// on `backend` (on node-a); a NodePort on `node_port` if given.
pub fn one_port_service(name: &str, vip: IpAddr, port: u16, target: u16, proto: &str, backend: IpAddr, node_port: Option<u16>) -> String {
    let family = if vip.is_ipv4() { "IPv4" } else { "IPv6" };
    let (kind, node_port) = match node_port {
        Some(p) => ("NodePort", format!(", nodePort: {p}")),
        None => ("ClusterIP", String::new()),
    };
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: demo}}\nspec:\n  type: {kind}\n  clusterIP: \"{vip}\"\n  \
         ipFamilies: [{family}]\n  ports: [{{name: p, port: {port}, targetPort: {target}{node_port}, protocol: {proto}}}]\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: {name}-1, namespace: demo, labels: {{kubernetes.io/service-name: {name}}}}}\n\
         addressType: {family}\nports: [{{name: p, port: {target}, protocol: {proto}}}]\n\
         endpoints: [{{addresses: [\"{backend}\"], nodeName: node-a}}]\n"
    )
}
