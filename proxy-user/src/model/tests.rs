use std::{collections::BTreeSet, net::IpAddr};

use proxy_common::*;

use super::{frontends::DEFAULT_AFFINITY_TIMEOUT_S, *};

fn cfg() -> ModelConfig {
    ModelConfig { node_name: "node-a".into(), ..Default::default() }
}

fn backends_of(state: &DesiredState, name: &str) -> Vec<String> {
    state
        .backend_sets
        .iter()
        .filter(|(k, _)| k.service.to_string() == name)
        .flat_map(|(_, v)| v.iter().map(|b| format!("{}:{}", b.addr, b.port)))
        .collect()
}

const WEB: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  ports:
  - {name: http, port: 80, targetPort: web}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.0.11], nodeName: node-a}
- {addresses: [10.244.0.12], conditions: {ready: false}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-2, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.0.13]}
- {addresses: [10.244.0.11]}
"#;

#[test]
fn cluster_ip_ports_get_ready_endpoints_from_all_slices_once() {
    let (state, errors) = build(&Snapshot::from_yaml(WEB), &cfg());
    // 10.244.0.11 is in both slices: served once, reported once per port.
    let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(text, [
        "endpointslice shop/web-2: endpoint 10.244.0.11:8080 duplicates one in endpointslice web-1; counted once",
        "endpointslice shop/web-2: endpoint 10.244.0.11:5353 duplicates one in endpointslice web-1; counted once",
    ]);
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.11:8080", "10.244.0.13:8080"]);
    assert_eq!(backends_of(&state, "shop/web:dns"), ["10.244.0.11:5353", "10.244.0.13:5353"]);
    let key = FrontendKey {
        addr: Addr::from("10.96.0.10".parse::<IpAddr>().unwrap()),
        port: 80u16.to_be(),
        proto: IPPROTO_TCP,
        scope: SCOPE_INTERNAL,
    };
    assert_eq!(state.frontends[&key].set.service.to_string(), "shop/web:http");
    // Two ports, each for in-cluster and other sources.
    assert_eq!(state.frontends.len(), 4);
    let local = state.backend_sets.values().flatten().find(|b| b.addr.to_string() == "10.244.0.11").unwrap();
    assert_ne!(local.flags & BACKEND_LOCAL, 0);
}

const DUAL_STACK: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:10:96::10"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: [192.0.2.7, "2001:db8:7::7"]
  loadBalancerSourceRanges: [203.0.113.0/24, "2001:db8:abcd::/48"]
  ports:
  - {name: http, port: 80, targetPort: 8080, nodePort: 30080}
status:
  loadBalancer:
    ingress: [{ip: 1.2.3.4}, {ip: "2001:db8:lb::1"}, {ip: "2001:db8:1b::1"}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: [10.244.0.11]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080}]
endpoints:
- {addresses: ["fd00:10:244::11"]}
- {addresses: [10.244.0.99]}
"#;

fn frontend_addrs(state: &DesiredState, name: &str, kind: u8) -> BTreeSet<String> {
    state
        .frontends
        .iter()
        .filter(|(_, f)| f.set.service.to_string() == name && f.kind == kind)
        .map(|(k, _)| k.addr.to_string())
        .collect()
}

#[test]
fn dual_stack_service_is_one_per_family_each_with_its_own_endpoints() {
    let config = ModelConfig {
        node_addresses: ["192.168.0.2", "2001:db8::1", "2001:db8:1::2"].map(|a| a.parse().unwrap()).to_vec(),
        ..cfg()
    };
    let (state, errors) = build(&Snapshot::from_yaml(DUAL_STACK), &config);
    let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
    // Reported once though the Service is built twice; the IPv4 address
    // in the IPv6 slice is refused, not proxied to from an IPv6 frontend.
    assert_eq!(text, [
        "service shop/web: status.loadBalancer.ingress: invalid IP \"2001:db8:lb::1\"; that address is skipped",
        "endpointslice shop/web-v6: endpoint address 10.244.0.99 is not of the slice's addressType IPv6; skipped",
    ]);
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.11:8080"]);
    assert_eq!(backends_of(&state, "shop/web:http (IPv6)"), ["fd00:10:244::11:8080"]);
    let set = |name: &str, kind| frontend_addrs(&state, name, kind);
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<String>>();
    assert_eq!(set("shop/web:http", KIND_CLUSTER_IP), strings(&["10.96.0.10"]));
    assert_eq!(set("shop/web:http (IPv6)", KIND_CLUSTER_IP), strings(&["fd00:10:96::10"]));
    assert_eq!(set("shop/web:http", KIND_NODE_PORT), strings(&["192.168.0.2"]));
    assert_eq!(set("shop/web:http (IPv6)", KIND_NODE_PORT), strings(&["2001:db8::1", "2001:db8:1::2"]));
    assert_eq!(set("shop/web:http", KIND_EXTERNAL_IP), strings(&["192.0.2.7"]));
    assert_eq!(set("shop/web:http (IPv6)", KIND_EXTERNAL_IP), strings(&["2001:db8:7::7"]));
    assert_eq!(set("shop/web:http", KIND_LOAD_BALANCER), strings(&["1.2.3.4"]));
    assert_eq!(set("shop/web:http (IPv6)", KIND_LOAD_BALANCER), strings(&["2001:db8:1b::1"]));
    // Each family's source ranges guard its own frontends.
    for (set, ranges) in &state.source_ranges {
        let want = if set.service.ipv6 { "2001:db8:abcd::/48" } else { "203.0.113.0/24" };
        assert_eq!(ranges.iter().map(ToString::to_string).collect::<Vec<_>>(), [want], "{}", set.service);
    }
    assert!(state.cluster_ips.contains(&"fd00:10:96::10".parse().unwrap()));
}

#[test]
fn ipv6_only_service_gets_ipv6_frontends_and_no_localhost_node_port() {
    let yaml = DUAL_STACK
        .replace("  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:10:96::10\"]", "  clusterIP: \"fd00:10:96::10\"")
        .replace("ipFamilies: [IPv4, IPv6]", "ipFamilies: [IPv6]");
    let config = ModelConfig {
        node_addresses: ["192.168.0.2", "2001:db8::1"].map(|a| a.parse().unwrap()).to_vec(),
        localhost_node_ports: true,
        ..cfg()
    };
    let (state, errors) = build(&Snapshot::from_yaml(&yaml), &config);
    assert!(errors.iter().any(|e| e.reason.contains("2001:db8:lb::1")), "{errors:?}");
    assert!(state.frontends.values().all(|f| f.set.service.ipv6), "an IPv4 frontend for an IPv6-only Service");
    assert!(state.frontends.keys().all(|k| !k.addr.is_v4()));
    assert_eq!(frontend_addrs(&state, "shop/web:http (IPv6)", KIND_NODE_PORT), BTreeSet::from(["2001:db8::1".to_string()]));
    assert_eq!(backends_of(&state, "shop/web:http (IPv6)"), ["fd00:10:244::11:8080"]);
}

#[test]
fn no_ready_endpoint_falls_back_to_serving_terminating() {
    let yaml = WEB.replace(
        "- {addresses: [10.244.0.13]}\n- {addresses: [10.244.0.11]}",
        "- {addresses: [10.244.0.13], conditions: {ready: false, serving: true, terminating: true}}",
    )
    .replace("- {addresses: [10.244.0.11], nodeName: node-a}\n", "");
    let (state, _) = build(&Snapshot::from_yaml(&yaml), &cfg());
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.13:8080"]);
}

#[test]
fn headless_externalname_and_bad_objects_are_skipped_with_reasons() {
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: headless, namespace: a}
spec: {clusterIP: None, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: ext, namespace: a}
spec: {type: ExternalName, externalName: example.com}
---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: a}
spec: {clusterIP: 10.96.300.1, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: badport, namespace: a}
spec: {clusterIP: 10.96.0.7, ports: [{name: a, port: 70000}, {name: b, port: 81, protocol: ICMP}, {name: c, port: 82}]}
"#;
    let (state, errors) = build(&Snapshot::from_yaml(yaml), &cfg());
    let names: BTreeSet<String> = state.frontends.values().map(|f| f.set.service.to_string()).collect();
    assert_eq!(names, BTreeSet::from(["a/badport:c".to_string()]));
    let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(text.iter().any(|e| e.starts_with("service a/bad:") && e.contains("10.96.300.1")), "{text:?}");
    assert!(text.iter().any(|e| e.contains("a/badport") && e.contains("70000")), "{text:?}");
    assert!(text.iter().any(|e| e.contains("a/badport") && e.contains("ICMP")), "{text:?}");
}

#[test]
fn sctp_ports_get_frontends_and_sctp_endpoints() {
    // Same port name and number for TCP and SCTP: each protocol keeps its own endpoints.
    let yaml = r#"
apiVersion: v1
kind: Service
metadata: {name: sig, namespace: tel}
spec:
  clusterIP: 10.96.0.30
  ports:
  - {name: m3ua, port: 2905, targetPort: 3905, protocol: SCTP}
  - {name: web, port: 2905, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sig-1, namespace: tel, labels: {kubernetes.io/service-name: sig}}
addressType: IPv4
ports: [{name: m3ua, port: 3905, protocol: SCTP}, {name: web, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.0.21]}
"#;
    let (state, errors) = build(&Snapshot::from_yaml(yaml), &cfg());
    assert!(errors.is_empty(), "{errors:?}");
    let addr = Addr::from("10.96.0.30".parse::<IpAddr>().unwrap());
    let sctp = FrontendKey { addr, port: 2905u16.to_be(), proto: IPPROTO_SCTP, scope: SCOPE_INTERNAL };
    assert_eq!(state.frontends[&sctp].set.service.to_string(), "tel/sig:m3ua");
    // Every frontend (each scope) the TCP port gets, the SCTP port gets too.
    let of = |proto| state.frontends.iter().filter(move |(k, _)| k.proto == proto);
    assert_eq!(of(IPPROTO_SCTP).count(), of(IPPROTO_TCP).count());
    assert!(of(IPPROTO_SCTP).all(|(_, f)| f.set.service.to_string() == "tel/sig:m3ua"));
    let set = &state.backend_sets[&state.frontends[&sctp].set];
    let got: Vec<(String, u16, u8)> = set.iter().map(|b| (b.addr.to_string(), b.port, b.proto)).collect();
    assert_eq!(got, [("10.244.0.21".to_string(), 3905, IPPROTO_SCTP)]);
}

#[test]
fn service_without_endpoints_has_an_empty_set() {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: lonely, namespace: a}\nspec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}\n";
    let (state, _) = build(&Snapshot::from_yaml(yaml), &cfg());
    assert_eq!(state.frontends.len(), 2);
    assert!(state.backend_sets.values().all(Vec::is_empty));
    // No endpoint anywhere: REJECT, not DROP.
    assert!(state.frontends.values().all(|f| f.flags & SVC_DROP_IF_EMPTY == 0));
    assert_eq!(state.cluster_ips.len(), 1);
}

const NODE_IP: &str = "192.168.0.2";

/// kube-proxy's test conventions: pods 10.0.0.0/8, node 192.168.0.2.
fn node_cfg() -> ModelConfig {
    ModelConfig {
        node_name: "node-a".into(),
        node_addresses: vec![NODE_IP.parse().unwrap(), "192.168.1.2".parse().unwrap()],
        node_port_addresses: vec!["192.168.0.2/32".parse().unwrap()],
        detect_local: true,
        masquerade_all: false,
        localhost_node_ports: false,
        service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
        lb_algorithm: LbAlgorithm::Random,
    }
}

/// A dual-stack Service whose slices hold, besides one pod each, every
/// kind of address that cannot be an endpoint; two ports, so a bad
/// address is reported once, not once per port.
const SPECIAL_ENDPOINTS: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIPs: [10.96.0.10, "fd00:10:96::10"]
  ports: [{name: http, port: 80}, {name: dns, port: 53, protocol: UDP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v4, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080}, {name: dns, port: 53, protocol: UDP}]
endpoints:
- {addresses: [127.0.0.1]}
- {addresses: [169.254.169.254]}
- {addresses: [224.0.0.251]}
- {addresses: [0.0.0.0]}
- {addresses: [255.255.255.255]}
- {addresses: [10.96.0.99]}
- {addresses: [10.244.0.11]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-v6, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv6
ports: [{name: http, port: 8080}, {name: dns, port: 53, protocol: UDP}]
endpoints:
- {addresses: ["::1"]}
- {addresses: ["fe80::1"]}
- {addresses: ["ff02::fb"]}
- {addresses: ["::"]}
- {addresses: ["::ffff:127.0.0.1"]}
- {addresses: ["fd00:10:244::11"]}
"#;

#[test]
fn addresses_that_cannot_be_endpoints_are_skipped_and_the_rest_is_served() {
    let (state, errors) = build(&Snapshot::from_yaml(SPECIAL_ENDPOINTS), &node_cfg());
    let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(text, [
        "endpointslice shop/web-v4: endpoint address 127.0.0.1 refused: loopback (127.0.0.0/8, ::1); skipped",
        "endpointslice shop/web-v4: endpoint address 169.254.169.254 refused: link-local (169.254.0.0/16, fe80::/10); skipped",
        "endpointslice shop/web-v4: endpoint address 224.0.0.251 refused: multicast (224.0.0.0/4, ff00::/8); skipped",
        "endpointslice shop/web-v4: endpoint address 0.0.0.0 refused: unspecified (0.0.0.0, ::); skipped",
        "endpointslice shop/web-v4: endpoint address 255.255.255.255 refused: broadcast (255.255.255.255); skipped",
        "endpointslice shop/web-v4: endpoint address 10.96.0.99 refused: in service CIDR 10.96.0.0/12, which holds only ClusterIPs; skipped",
        "endpointslice shop/web-v6: endpoint address ::1 refused: loopback (127.0.0.0/8, ::1); skipped",
        "endpointslice shop/web-v6: endpoint address fe80::1 refused: link-local (169.254.0.0/16, fe80::/10); skipped",
        "endpointslice shop/web-v6: endpoint address ff02::fb refused: multicast (224.0.0.0/4, ff00::/8); skipped",
        "endpointslice shop/web-v6: endpoint address :: refused: unspecified (0.0.0.0, ::); skipped",
        "endpointslice shop/web-v6: endpoint address ::ffff:127.0.0.1 refused: IPv4-mapped (::ffff:0:0/96); skipped",
    ]);
    assert!(errors.iter().all(|e| crate::metrics::classify(e) == ("EndpointSlice", "invalid_endpoint")), "{errors:?}");
    // The rest of each slice, and every port and frontend, still served.
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.11:8080"]);
    assert_eq!(backends_of(&state, "shop/web:dns"), ["10.244.0.11:53"]);
    assert_eq!(backends_of(&state, "shop/web:http (IPv6)"), ["fd00:10:244::11:8080"]);
    assert_eq!(backends_of(&state, "shop/web:dns (IPv6)"), ["fd00:10:244::11:53"]);
    assert_eq!(state.frontends.len(), 8, "two ports, two families, two scopes");
    assert_eq!(state.backends.len(), 4);
}

#[test]
fn the_effective_service_cidrs_decide_which_endpoints_are_refused() {
    // A ServiceCIDR object replaces the flag for endpoints as for drops:
    // 10.96.0.99 is served, an endpoint in the object's CIDR is not.
    let yaml = format!(
        "{}---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: kubernetes}}\nspec: {{cidrs: [10.200.0.0/16]}}\n",
        SPECIAL_ENDPOINTS.replace("- {addresses: [127.0.0.1]}", "- {addresses: [10.200.0.5]}")
    );
    let (state, errors) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.96.0.99:8080", "10.244.0.11:8080"]);
    assert!(errors.iter().any(|e| e.reason.starts_with("endpoint address 10.200.0.5 refused: in service CIDR 10.200.0.0/16")), "{errors:?}");
    assert!(!errors.iter().any(|e| e.reason.contains("10.96.0.99")), "{errors:?}");
    // Without any service CIDR, only the special addresses are refused.
    let config = ModelConfig { service_cidrs: vec![], ..node_cfg() };
    let (state, _) = build(&Snapshot::from_yaml(SPECIAL_ENDPOINTS), &config);
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.96.0.99:8080", "10.244.0.11:8080"]);
}

#[test]
fn service_cidr_objects_replace_the_flag_and_their_bad_entries_are_reported() {
    let flag = |state: &DesiredState| state.service_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>();
    let (state, errors) = build(&Snapshot::from_yaml(WEB), &node_cfg());
    assert!(errors.iter().all(|e| !e.object.starts_with("servicecidr")), "{errors:?}");
    assert_eq!(flag(&state), ["10.96.0.0/12"]);
    let yaml = format!(
        "{WEB}---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: kubernetes}}\n\
         spec: {{cidrs: [10.96.0.0/16, 10.96.0.0/99]}}\n"
    );
    let (state, errors) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    assert_eq!(flag(&state), ["10.96.0.0/16"]);
    let text: Vec<String> = errors.iter().filter(|e| e.object.starts_with("servicecidr")).map(ToString::to_string).collect();
    assert_eq!(text, ["servicecidr kubernetes: spec.cidrs[1]: invalid CIDR \"10.96.0.0/99\"; skipped"]);
    // The Services are built as before.
    assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.11:8080", "10.244.0.13:8080"]);
}

/// A LoadBalancer Service with an ExternalIP, NodePort 30080 and one
/// endpoint on this node and one elsewhere.
fn lb(extra_spec: &str, local_ready: bool) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: lb, namespace: ns}}
spec:
  type: LoadBalancer
  clusterIP: 172.30.0.42
  externalIPs: [192.168.99.22]
  ports: [{{name: p80, port: 80, nodePort: 30080}}]
  {extra_spec}
status: {{loadBalancer: {{ingress: [{{ip: 1.2.3.4}}]}}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: lb-1, namespace: ns, labels: {{kubernetes.io/service-name: lb}}}}
addressType: IPv4
ports: [{{name: p80, port: 8080}}]
endpoints:
- {{addresses: [10.180.0.1], nodeName: node-a, conditions: {{ready: {local_ready}}}}}
- {{addresses: [10.180.0.2], nodeName: node-b}}
"#
    )
}

/// (kind, scope) -> (backends, flags) for every frontend on `ip:port`.
fn frontends_at(state: &DesiredState, ip: &str, port: u16) -> Vec<(u8, u8, Vec<String>, u8)> {
    let addr = Addr::from(ip.parse::<IpAddr>().unwrap());
    state
        .frontends
        .iter()
        .filter(|(k, _)| k.addr == addr && k.port == port.to_be())
        .map(|(k, f)| {
            let backends = state.backend_sets[&f.set].iter().map(|b| b.addr.to_string()).collect();
            (f.kind, k.scope, backends, f.flags)
        })
        .collect()
}

#[test]
fn external_traffic_policy_cluster_masquerades_every_external_frontend() {
    let (state, errors) = build(&Snapshot::from_yaml(&lb("externalTrafficPolicy: Cluster", true)), &node_cfg());
    assert!(errors.is_empty(), "{errors:?}");
    let both = vec!["10.180.0.1".to_string(), "10.180.0.2".to_string()];
    for (ip, port, kind) in [(NODE_IP, 30080, KIND_NODE_PORT), ("192.168.99.22", 80, KIND_EXTERNAL_IP), ("1.2.3.4", 80, KIND_LOAD_BALANCER)] {
        let want = vec![(kind, SCOPE_INTERNAL, both.clone(), SVC_MASQUERADE), (kind, SCOPE_EXTERNAL, both.clone(), SVC_MASQUERADE)];
        assert_eq!(frontends_at(&state, ip, port), want, "{ip}:{port}");
    }
    // NodePorts only on --node-port-addresses.
    assert!(frontends_at(&state, "192.168.1.2", 30080).is_empty());
    // The ClusterIP masquerades only sources outside the cluster CIDR.
    let want = vec![(KIND_CLUSTER_IP, SCOPE_INTERNAL, both.clone(), 0), (KIND_CLUSTER_IP, SCOPE_EXTERNAL, both, SVC_MASQUERADE)];
    assert_eq!(frontends_at(&state, "172.30.0.42", 80), want);
}

#[test]
fn external_traffic_policy_local_keeps_the_client_and_short_circuits_pods() {
    let (state, _) = build(&Snapshot::from_yaml(&lb("externalTrafficPolicy: Local", true)), &node_cfg());
    let local = vec!["10.180.0.1".to_string()];
    let both = vec!["10.180.0.1".to_string(), "10.180.0.2".to_string()];
    assert_eq!(
        frontends_at(&state, "1.2.3.4", 80),
        vec![(KIND_LOAD_BALANCER, SCOPE_INTERNAL, both, 0), (KIND_LOAD_BALANCER, SCOPE_EXTERNAL, local, 0)]
    );
    // No local endpoint: external sources are dropped, pods still served.
    let (state, _) = build(&Snapshot::from_yaml(&lb("externalTrafficPolicy: Local", false)), &node_cfg());
    let got = frontends_at(&state, NODE_IP, 30080);
    assert_eq!(got[0], (KIND_NODE_PORT, SCOPE_INTERNAL, vec!["10.180.0.2".to_string()], 0));
    assert_eq!(got[1], (KIND_NODE_PORT, SCOPE_EXTERNAL, vec![], SVC_DROP_IF_EMPTY));
}

#[test]
fn local_policies_fall_back_to_local_serving_terminating_endpoints() {
    let yaml = lb("internalTrafficPolicy: Local", false)
        .replace("conditions: {ready: false}", "conditions: {ready: false, serving: true, terminating: true}");
    let (state, _) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    let got = frontends_at(&state, "172.30.0.42", 80);
    assert_eq!(got[0], (KIND_CLUSTER_IP, SCOPE_INTERNAL, vec!["10.180.0.1".to_string()], 0));
    // With nothing local at all, internal traffic is dropped (endpoints exist elsewhere).
    let yaml = lb("internalTrafficPolicy: Local", false);
    let (state, _) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    assert_eq!(frontends_at(&state, "172.30.0.42", 80)[0], (KIND_CLUSTER_IP, SCOPE_INTERNAL, vec![], SVC_DROP_IF_EMPTY));
}

#[test]
fn source_ranges_guard_load_balancer_ips_only_and_affinity_defaults() {
    let extra = "loadBalancerSourceRanges: [' 203.0.113.0/25', bogus]\n  sessionAffinity: ClientIP";
    let (state, errors) = build(&Snapshot::from_yaml(&lb(extra, true)), &node_cfg());
    assert!(errors.iter().any(|e| e.reason.contains("bogus")), "{errors:?}");
    for (_, f) in state.frontends.iter() {
        assert_eq!(f.flags & SVC_SOURCE_RANGES != 0, f.kind == KIND_LOAD_BALANCER, "{f:?}");
        assert_eq!(f.affinity_timeout_s, DEFAULT_AFFINITY_TIMEOUT_S);
    }
    let nets: BTreeSet<String> = state.source_ranges.values().flatten().map(ToString::to_string).collect();
    assert_eq!(nets, BTreeSet::from(["203.0.113.0/25".to_string()]));
}

#[test]
fn source_ranges_admitting_the_node_admit_the_lb_ips_too() {
    let ranges_of = |ranges: &str| {
        let (state, _) = build(&Snapshot::from_yaml(&lb(&format!("loadBalancerSourceRanges: [{ranges}]"), true)), &node_cfg());
        state.source_ranges.values().flatten().map(ToString::to_string).collect::<BTreeSet<String>>()
    };
    let with_node = ranges_of("192.168.0.0/24, 203.0.113.0/25");
    assert_eq!(with_node, BTreeSet::from(["192.168.0.0/24", "203.0.113.0/25", "1.2.3.4/32"].map(String::from)));
    assert_eq!(ranges_of("203.0.113.0/25"), BTreeSet::from(["203.0.113.0/25".to_string()]));
}

#[test]
fn lb_ips_in_proxy_mode_get_no_frontend() {
    let yaml = lb("loadBalancerSourceRanges: [192.168.0.0/24]", true).replace(
        "ingress: [{ip: 1.2.3.4}]",
        "ingress: [{ip: 1.2.3.4, ipMode: Proxy}, {ip: 1.2.3.5, ipMode: VIP}, {ip: 1.2.3.6}, {ip: 1.2.3.7, ipMode: Tunnel}]",
    );
    let (state, errors) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    // The Proxy-mode IP is the real load balancer's: no frontend, so
    // clients in the cluster reach it; VIP or no mode: as before.
    assert!(frontends_at(&state, "1.2.3.4", 80).is_empty());
    for ip in ["1.2.3.5", "1.2.3.6"] {
        assert_eq!(frontends_at(&state, ip, 80).len(), 2, "{ip}");
    }
    let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(text, ["service ns/lb: status.loadBalancer.ingress[3].ipMode: unknown mode \"Tunnel\"; that address is skipped"]);
    assert!(frontends_at(&state, "1.2.3.7", 80).is_empty());
    // Ranges admitting the node admit only the LB IPs that are served.
    let nets: BTreeSet<String> = state.source_ranges.values().flatten().map(ToString::to_string).collect();
    assert_eq!(nets, BTreeSet::from(["192.168.0.0/24", "1.2.3.5/32", "1.2.3.6/32"].map(String::from)));
}

#[test]
fn a_service_whose_only_lb_ip_is_in_proxy_mode_is_not_externally_accessible() {
    let yaml = lb("", true)
        .replace("  externalIPs: [192.168.99.22]\n", "")
        .replace(", nodePort: 30080", "")
        .replace("ingress: [{ip: 1.2.3.4}]", "ingress: [{ip: 1.2.3.4, ipMode: Proxy}]");
    let (state, errors) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    assert!(errors.is_empty(), "{errors:?}");
    assert!(state.frontends.values().all(|f| f.kind == KIND_CLUSTER_IP), "{:?}", state.frontends);
}

/// A Service `victim` with ClusterIP 10.96.0.10:53/UDP, and a `tenant`
/// Service in namespace `tenant_ns` whose ExternalIPs list that ClusterIP
/// (and one address of its own), both serving port 53/UDP.
fn cluster_ip_claimed_as_external_ip(tenant_ns: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: dns, namespace: kube-system, creationTimestamp: "2025-06-01T00:00:00Z"}}
spec: {{clusterIP: 10.96.0.10, ports: [{{name: dns, port: 53, protocol: UDP}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: dns-1, namespace: kube-system, labels: {{kubernetes.io/service-name: dns}}}}
addressType: IPv4
ports: [{{name: dns, port: 53, protocol: UDP}}]
endpoints: [{{addresses: [10.244.0.53]}}]
---
apiVersion: v1
kind: Service
metadata: {{name: grab, namespace: {tenant_ns}, creationTimestamp: "2025-01-01T00:00:00Z"}}
spec: {{clusterIP: 10.96.0.99, externalIPs: [10.96.0.10, 192.0.2.99], ports: [{{name: dns, port: 53, protocol: UDP}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: grab-1, namespace: {tenant_ns}, labels: {{kubernetes.io/service-name: grab}}}}
addressType: IPv4
ports: [{{name: dns, port: 53, protocol: UDP}}]
endpoints: [{{addresses: [10.244.6.66]}}]
"#
    )
}

#[test]
fn a_cluster_ip_is_never_taken_by_another_services_external_ip() {
    // The tenant is older, and sorts before and after kube-system: the
    // ClusterIP wins every time.
    for tenant_ns in ["aaa", "zzz"] {
        let (state, errors) = build(&Snapshot::from_yaml(&cluster_ip_claimed_as_external_ip(tenant_ns)), &node_cfg());
        let dns = vec!["10.244.0.53".to_string()];
        let at = |ip| frontends_at(&state, ip, 53).into_iter().map(|(kind, _, backends, _)| (kind, backends)).collect::<Vec<_>>();
        assert_eq!(at("10.96.0.10"), vec![(KIND_CLUSTER_IP, dns.clone()), (KIND_CLUSTER_IP, dns)], "tenant in {tenant_ns}");
        // The rest of the tenant's Service is still served.
        let grab = vec!["10.244.6.66".to_string()];
        assert_eq!(at("10.96.0.99"), vec![(KIND_CLUSTER_IP, grab.clone()), (KIND_CLUSTER_IP, grab.clone())]);
        assert_eq!(at("192.0.2.99"), vec![(KIND_EXTERNAL_IP, grab.clone()), (KIND_EXTERNAL_IP, grab)]);
        // Reported once (not once per scope), naming both Services.
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(text, [format!(
            "service {tenant_ns}/grab: ExternalIP 10.96.0.10:53/UDP is also service kube-system/dns's ClusterIP, \
             which is served there (frontend conflict); skipped"
        )]);
        assert_eq!(crate::metrics::classify(&errors[0]), ("Service", "frontend_conflict"));
    }
}

#[test]
fn a_cluster_ip_is_never_taken_by_another_services_lb_ip() {
    for tenant_ns in ["aaa", "zzz"] {
        let yaml = cluster_ip_claimed_as_external_ip(tenant_ns).replace(
            "externalIPs: [10.96.0.10, 192.0.2.99], ports: [{name: dns, port: 53, protocol: UDP}]}",
            "ports: [{name: dns, port: 53, protocol: UDP}]}\nstatus: {loadBalancer: {ingress: [{ip: 10.96.0.10}]}}",
        );
        let (state, errors) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
        assert!(frontends_at(&state, "10.96.0.10", 53).iter().all(|(kind, ..)| *kind == KIND_CLUSTER_IP), "{yaml}");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].reason.starts_with("LoadBalancer 10.96.0.10:53/UDP is also service kube-system/dns's ClusterIP"), "{errors:?}");
    }
}

/// Two Services `first` and `second` (in namespaces `a` and `b`, with
/// the given metadata) listing the same ExternalIP on one port.
fn shared_external_ip(first: &str, second: &str) -> String {
    [("a", first, "10.96.0.1"), ("b", second, "10.96.0.2")]
        .map(|(ns, meta, cluster_ip)| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: {ns}{meta}}}\n\
                 spec: {{clusterIP: {cluster_ip}, externalIPs: [192.0.2.1], ports: [{{port: 80}}]}}\n"
            )
        })
        .join("---\n")
}

fn served_by(state: &DesiredState, ip: &str, port: u16) -> BTreeSet<String> {
    let addr = Addr::from(ip.parse::<IpAddr>().unwrap());
    state.frontends.iter().filter(|(k, _)| k.addr == addr && k.port == port.to_be()).map(|(_, f)| f.set.service.to_string()).collect()
}

#[test]
fn an_external_ip_two_services_claim_goes_to_the_older_then_by_name() {
    let older = ", creationTimestamp: '2025-01-01T00:00:00Z'";
    let newer = ", creationTimestamp: '2025-02-01T00:00:00Z'";
    for (first, second, winner, loser) in [
        (newer, older, "b/web", "a/web"),
        (older, newer, "a/web", "b/web"),
        // A Service with a timestamp before one without (manifests seldom have one).
        ("", newer, "b/web", "a/web"),
        // Neither has one: namespace/name.
        ("", "", "a/web", "b/web"),
    ] {
        let (state, errors) = build(&Snapshot::from_yaml(&shared_external_ip(first, second)), &cfg());
        assert_eq!(served_by(&state, "192.0.2.1", 80), BTreeSet::from([winner.to_string()]), "{first} {second}");
        let text: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(text, [format!(
            "service {loser}: ExternalIP 192.0.2.1:80/TCP is also service {winner}'s ExternalIP, which is served there (frontend conflict); skipped"
        )]);
    }
}

#[test]
fn an_external_ip_on_a_node_address_takes_another_services_node_port() {
    // kube-proxy matches service IPs before NodePorts, whatever the names or ages.
    let yaml = format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: a, namespace: a, creationTimestamp: "2025-01-01T00:00:00Z"}}
spec: {{type: NodePort, clusterIP: 10.96.0.1, ports: [{{port: 80, nodePort: 30080}}]}}
---
apiVersion: v1
kind: Service
metadata: {{name: z, namespace: z}}
spec: {{clusterIP: 10.96.0.2, externalIPs: [{NODE_IP}], ports: [{{port: 30080}}]}}
"#
    );
    let (state, errors) = build(&Snapshot::from_yaml(&yaml), &node_cfg());
    assert_eq!(served_by(&state, NODE_IP, 30080), BTreeSet::from(["z/z".to_string()]));
    assert!(errors[0].to_string().starts_with(&format!("service a/a: NodePort {NODE_IP}:30080/TCP is also service z/z's ExternalIP")), "{errors:?}");
}

#[test]
fn a_services_own_cluster_ip_listed_as_its_external_ip_stays_a_cluster_ip() {
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: a}\n\
                spec: {clusterIP: 10.96.0.1, externalIPs: [10.96.0.1], ports: [{port: 80}]}\n";
    let (state, errors) = build(&Snapshot::from_yaml(yaml), &cfg());
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(frontends_at(&state, "10.96.0.1", 80).iter().map(|f| f.0).collect::<Vec<_>>(), [KIND_CLUSTER_IP, KIND_CLUSTER_IP]);
}

/// `web` with an `ebpf-proxy.io/lb-algorithm` annotation (none if empty).
fn web_with_algorithm(value: &str) -> String {
    let annotation =
        if value.is_empty() { String::new() } else { format!(", annotations: {{{LB_ALGORITHM_ANNOTATION}: {value}}}") };
    WEB.replace("metadata: {name: web, namespace: shop}", &format!("metadata: {{name: web, namespace: shop{annotation}}}"))
}

fn maglev_frontends(state: &DesiredState) -> usize {
    state.frontends.values().filter(|f| f.flags & SVC_MAGLEV != 0).count()
}

#[test]
fn the_lb_algorithm_annotation_flags_a_services_frontends_and_sets() {
    let (state, errors) = build(&Snapshot::from_yaml(&web_with_algorithm("maglev")), &cfg());
    assert!(errors.iter().all(|e| e.why != SkipReason::UnknownLbAlgorithm));
    assert_eq!(maglev_frontends(&state), state.frontends.len());
    assert_eq!(state.maglev.len(), 2, "both ports' sets: {:?}", state.maglev);
    assert!(state.maglev.iter().all(|set| state.wants_maglev_table(set)));

    let (state, _) = build(&Snapshot::from_yaml(&web_with_algorithm("")), &cfg());
    assert_eq!((maglev_frontends(&state), state.maglev.len()), (0, 0), "random by default");

    // The flag sets the default; the annotation still decides.
    let maglev_default = ModelConfig { lb_algorithm: LbAlgorithm::Maglev, ..cfg() };
    let (state, _) = build(&Snapshot::from_yaml(&web_with_algorithm("")), &maglev_default);
    assert_eq!((maglev_frontends(&state), state.maglev.len()), (state.frontends.len(), 2));
    let (state, _) = build(&Snapshot::from_yaml(&web_with_algorithm("random")), &maglev_default);
    assert_eq!((maglev_frontends(&state), state.maglev.len()), (0, 0));
}

#[test]
fn an_unknown_lb_algorithm_is_reported_and_the_default_serves() {
    for default in [LbAlgorithm::Random, LbAlgorithm::Maglev] {
        let config = ModelConfig { lb_algorithm: default, ..cfg() };
        let (state, errors) = build(&Snapshot::from_yaml(&web_with_algorithm("ring-hash")), &config);
        let bad: Vec<String> = errors.iter().filter(|e| e.why == SkipReason::UnknownLbAlgorithm).map(ToString::to_string).collect();
        assert_eq!(bad, [format!(
            "service shop/web: metadata.annotations[ebpf-proxy.io/lb-algorithm]: unknown algorithm \"ring-hash\" \
             (maglev or random); served with the default, {}",
            default.name()
        )]);
        assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.11:8080", "10.244.0.13:8080"], "still served");
        let maglev = default == LbAlgorithm::Maglev;
        assert_eq!(maglev_frontends(&state) == state.frontends.len() && !state.frontends.is_empty(), maglev);
    }
}

/// A set without endpoints is flagged but gets no table: its frontends
/// reject before any table would be read.
#[test]
fn a_maglev_set_without_endpoints_wants_no_table() {
    let yaml = web_with_algorithm("maglev");
    let no_endpoints = &yaml[..yaml.find("---\napiVersion: discovery.k8s.io/v1").unwrap()];
    let (state, _) = build(&Snapshot::from_yaml(no_endpoints), &cfg());
    assert_eq!(state.maglev.len(), 2);
    assert!(state.maglev.iter().all(|set| !state.wants_maglev_table(set)));
}
