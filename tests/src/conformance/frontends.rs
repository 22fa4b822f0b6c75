//! What `ebpf-proxy dump services` must show for a setup: every frontend
//! kube-proxy would program for its Services, by kind (ClusterIP, NodePort on
//! each node address `--node-port-addresses` selects, ExternalIP,
//! LoadBalancer), each with a scope. Only Services with a serving endpoint
//! are required: how a Service without one is REJECTed is the datapath's
//! business, checked by the packet cases.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
};

use ipnet::IpNet;
use serde_yaml::Value;

use super::cluster::{NODE_IPS, NODE_IPS6};

/// (kind, "address:port/PROTO"), as `dump services -o json` names them.
pub type Frontend = (String, String);

/// Whether `ip` is in `cidr` (surrounding blanks allowed). A CIDR of the
/// other family selects nothing.
pub fn in_cidr(ip: IpAddr, cidr: &str) -> bool {
    cidr.trim().parse::<IpNet>().is_ok_and(|net| net.contains(&ip))
}

/// An endpoint kube-proxy may send to: serving (which defaults to ready,
/// which defaults to true), whether or not terminating.
fn serving(endpoint: &Value) -> bool {
    let c = &endpoint["conditions"];
    c["serving"].as_bool().unwrap_or(c["ready"].as_bool().unwrap_or(true))
}

/// The frontends `objects` call for, on a node whose NodePorts listen on
/// the node addresses `node_port_addresses` selects (None: all of them).
pub fn expected(objects: &[Value], node_port_addresses: Option<&[String]>) -> BTreeSet<Frontend> {
    let with_endpoints: BTreeSet<(String, String)> = objects
        .iter()
        .filter(|o| o["kind"].as_str() == Some("EndpointSlice"))
        .filter(|o| o["endpoints"].as_sequence().into_iter().flatten().any(serving))
        .filter_map(|o| {
            let ns = o["metadata"]["namespace"].as_str()?;
            let svc = o["metadata"]["labels"]["kubernetes.io/service-name"].as_str()?;
            Some((ns.to_string(), svc.to_string()))
        })
        .collect();
    // An IPv6 setup's node also has the IPv6 addresses (see cluster.rs);
    // a Service's NodePorts open on the addresses of its own family.
    let node_ips: Vec<IpAddr> = NODE_IPS
        .iter()
        .map(|ip| IpAddr::V4(*ip))
        .chain(NODE_IPS6.iter().map(|ip| IpAddr::V6(*ip)))
        .filter(|ip| node_port_addresses.is_none_or(|cidrs| cidrs.iter().any(|c| in_cidr(*ip, c))))
        .collect();

    let mut want = BTreeSet::new();
    for svc in objects.iter().filter(|o| o["kind"].as_str() == Some("Service")) {
        let meta = &svc["metadata"];
        let key = (meta["namespace"].as_str().unwrap_or("default").to_string(), meta["name"].as_str().unwrap_or("").to_string());
        if !with_endpoints.contains(&key) {
            continue;
        }
        let spec = &svc["spec"];
        let kind = spec["type"].as_str().unwrap_or("ClusterIP");
        let Some(cluster_ip) = spec["clusterIP"].as_str().and_then(|s| s.parse::<IpAddr>().ok()) else { continue };
        let same_family = |s: &Value| s.as_str().and_then(|s| s.trim().parse::<IpAddr>().ok()).filter(|ip| ip.is_ipv4() == cluster_ip.is_ipv4());
        let external_ips: Vec<IpAddr> = spec["externalIPs"].as_sequence().into_iter().flatten().filter_map(same_family).collect();
        let lb_ips: Vec<IpAddr> = if kind == "LoadBalancer" {
            // ipMode Proxy: the load balancer proxies, so no frontend (KEP-1860).
            let vip = |i: &&Value| i["ipMode"].as_str() != Some("Proxy");
            svc["status"]["loadBalancer"]["ingress"].as_sequence().into_iter().flatten().filter(vip).filter_map(|i| same_family(&i["ip"])).collect()
        } else {
            Vec::new()
        };
        for port in spec["ports"].as_sequence().into_iter().flatten() {
            let proto = port["protocol"].as_str().unwrap_or("TCP");
            let Some(p) = port["port"].as_u64() else { continue };
            let mut add = |kind: &str, ip: IpAddr, p: u64| {
                want.insert((kind.to_string(), format!("{}/{proto}", SocketAddr::new(ip, p as u16))));
            };
            add("ClusterIP", cluster_ip, p);
            if let Some(node_port) = port["nodePort"].as_u64().filter(|_| kind == "NodePort" || kind == "LoadBalancer") {
                for ip in node_ips.iter().filter(|ip| ip.is_ipv4() == cluster_ip.is_ipv4()) {
                    add("NodePort", *ip, node_port);
                }
            }
            for ip in &external_ips {
                add("ExternalIP", *ip, p);
            }
            for ip in &lb_ips {
                add("LoadBalancer", *ip, p);
            }
        }
    }
    // A ClusterIP is never another Service's ExternalIP or LB IP frontend.
    let cluster_ips: BTreeSet<String> = want.iter().filter(|(kind, _)| kind == "ClusterIP").map(|(_, f)| f.clone()).collect();
    want.retain(|(kind, f)| kind == "ClusterIP" || kind == "NodePort" || !cluster_ips.contains(f));
    want
}

/// The frontends a `dump services -o json` document lists with a scope.
pub fn dumped(rows: &serde_json::Value) -> BTreeSet<Frontend> {
    rows.as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["scope"].as_str().is_some_and(|s| !s.is_empty()))
        .filter_map(|r| {
            // Only the protocol is case-insensitive: IPv6 hex digits are lower case.
            let (addr, proto) = r["frontend"].as_str()?.rsplit_once('/')?;
            Some((r["type"].as_str()?.to_string(), format!("{addr}/{}", proto.to_uppercase())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs() {
        let ip: IpAddr = "192.168.1.2".parse().unwrap();
        assert!(in_cidr(ip, "192.168.1.0/24"));
        assert!(in_cidr(ip, " 192.168.1.2/32"));
        assert!(!in_cidr(ip, "192.168.0.0/24"));
        assert!(in_cidr(ip, "0.0.0.0/0"));
        assert!(!in_cidr(ip, "2001:db8::/64"));
        assert!(in_cidr("2001:db8::1".parse().unwrap(), "2001:db8::/64"));
        assert!(!in_cidr("2001:db8:1::2".parse().unwrap(), "2001:db8::/64"));
    }

    #[test]
    fn every_kind_of_frontend_is_expected() {
        let objects: Vec<Value> = serde_yaml::from_str(
            r#"
- apiVersion: v1
  kind: Service
  metadata: {name: s, namespace: n}
  spec:
    type: LoadBalancer
    clusterIP: 172.30.0.41
    externalIPs: [192.168.99.11]
    ports: [{name: p, port: 80, protocol: TCP, nodePort: 3001}]
  status: {loadBalancer: {ingress: [{ip: 1.2.3.4}]}}
- apiVersion: v1
  kind: Service
  metadata: {name: idle, namespace: n}
  spec: {clusterIP: 172.30.0.42, ports: [{name: p, port: 80, protocol: TCP}]}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata: {name: s-1, namespace: n, labels: {kubernetes.io/service-name: s}}
  addressType: IPv4
  endpoints: [{addresses: [10.180.0.1]}]
  ports: [{name: p, port: 80, protocol: TCP}]
"#,
        )
        .unwrap();
        let f = |k: &str, a: &str| (k.to_string(), a.to_string());
        let only_first = expected(&objects, Some(&["192.168.0.2/32".to_string()]));
        assert_eq!(
            only_first,
            [
                f("ClusterIP", "172.30.0.41:80/TCP"),
                f("ExternalIP", "192.168.99.11:80/TCP"),
                f("LoadBalancer", "1.2.3.4:80/TCP"),
                f("NodePort", "192.168.0.2:3001/TCP"),
            ]
            .into_iter()
            .collect()
        );
        assert_eq!(expected(&objects, None).iter().filter(|(k, _)| k == "NodePort").count(), NODE_IPS.len());
        let v6 = serde_yaml::to_string(&objects).unwrap().replace("172.30.0.41", "fd00:172:30::41").replace("IPv4", "IPv6");
        let v6: Vec<Value> = serde_yaml::from_str(&v6).unwrap();
        let nodeports: Vec<_> = expected(&v6, Some(&["192.168.0.2/32".into(), "2001:db8::/64".into()]))
            .into_iter()
            .filter(|(k, _)| k == "NodePort" || k == "ClusterIP")
            .collect();
        assert_eq!(nodeports, vec![f("ClusterIP", "[fd00:172:30::41]:80/TCP"), f("NodePort", "[2001:db8::1]:3001/TCP")]);
    }
}
