//! The policy: a pure function from Services, EndpointSlices and the node to
//! the frontends and backend sets the datapath should hold. The BPF side only
//! executes what is decided here, so this is where behaviour is tested.

use std::{
    collections::BTreeMap,
    fmt,
    net::IpAddr,
};

use k8s_openapi::api::{
    discovery::v1::{Endpoint, EndpointSlice},
};
use proxy_common::{
    Addr, BACKEND_LOCAL, BACKEND_READY, BACKEND_SERVING, BACKEND_TERMINATING, FrontendKey, IPPROTO_SCTP,
    IPPROTO_TCP, IPPROTO_UDP, KIND_CLUSTER_IP, SCOPE_INTERNAL,
};

use crate::source::Snapshot;

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

#[derive(Debug, Clone, Default)]
pub struct ModelConfig {
    pub node_name: String,
}

/// `namespace/name:port-name`, as kube-proxy prints a service port.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        Ok(())
    }
}

/// One backend set: the endpoints a service port offers to one scope of clients.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSetKey {
    pub service: ServicePortName,
    pub scope: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DesiredBackend {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
    /// BACKEND_* flags.
    pub flags: u8,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredFrontend {
    pub set: BackendSetKey,
    pub kind: u8,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Sorted and free of duplicates, so equal inputs give equal slots.
    pub backend_sets: BTreeMap<BackendSetKey, Vec<DesiredBackend>>,
    pub frontends: BTreeMap<FrontendKey, DesiredFrontend>,
}

/// Something in an object that was skipped, with the object it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectError {
    pub object: String,
    pub reason: String,
}

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

pub fn build(snapshot: &Snapshot, config: &ModelConfig) -> (DesiredState, Vec<ObjectError>) {
    let mut state = DesiredState::default();
    let mut errors = Vec::new();

    let mut slices_by_service: BTreeMap<(String, String), Vec<&EndpointSlice>> = BTreeMap::new();
    for slice in &snapshot.slices {
        let ns = slice.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        match slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)) {
            Some(svc) => slices_by_service.entry((ns, svc.clone())).or_default().push(slice),
            None => errors.push(ObjectError {
                object: format!("endpointslice {ns}/{}", slice.metadata.name.as_deref().unwrap_or("?")),
                reason: format!("no {SERVICE_NAME_LABEL} label; ignored"),
            }),
        }
    }

    for svc in &snapshot.services {
        let ns = svc.metadata.namespace.clone().unwrap_or_else(|| "default".into());
        let name = svc.metadata.name.clone().unwrap_or_default();
        let object = format!("service {ns}/{name}");
        let skip = |errors: &mut Vec<ObjectError>, reason: String| errors.push(ObjectError { object: object.clone(), reason });
        let Some(spec) = &svc.spec else {
            skip(&mut errors, "no spec; skipped".into());
            continue;
        };
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let ips: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
            (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
            (_, Some(ip)) => vec![ip],
            _ => vec![],
        };
        if ips.iter().any(|ip| ip.as_str() == "None") {
            continue; // headless: DNS only, nothing to proxy
        }
        let mut cluster_ips = Vec::new();
        for ip in ips {
            match ip.parse::<IpAddr>() {
                // The datapath translates IPv4 today; the keys already hold IPv6.
                Ok(ip) if ip.is_ipv4() => cluster_ips.push(ip),
                Ok(_) => {}
                Err(_) => skip(&mut errors, format!("spec.clusterIPs: invalid IP {ip:?}; that address is skipped")),
            }
        }
        if cluster_ips.is_empty() {
            continue;
        }
        let slices = slices_by_service.get(&(ns.clone(), name.clone())).map(Vec::as_slice).unwrap_or(&[]);

        for (i, port) in spec.ports.iter().flatten().enumerate() {
            let Some(proto) = protocol_of(port.protocol.as_deref()) else {
                skip(&mut errors, format!("spec.ports[{i}]: unknown protocol {:?}; port skipped", port.protocol));
                continue;
            };
            let Ok(port_num) = u16::try_from(port.port).map_err(drop).and_then(|p| if p == 0 { Err(()) } else { Ok(p) })
            else {
                skip(&mut errors, format!("spec.ports[{i}].port: {} out of range; port skipped", port.port));
                continue;
            };
            let service = ServicePortName { namespace: ns.clone(), name: name.clone(), port: port.name.clone().unwrap_or_default() };
            let backends = select_endpoints(slices, &service.port, proto, config, &mut errors);
            let set = BackendSetKey { service, scope: SCOPE_INTERNAL };
            for ip in &cluster_ips {
                let key = FrontendKey { addr: Addr::from(*ip), port: port_num.to_be(), proto, scope: SCOPE_INTERNAL };
                state.frontends.insert(key, DesiredFrontend { set: set.clone(), kind: KIND_CLUSTER_IP });
            }
            state.backend_sets.insert(set, backends);
        }
    }
    (state, errors)
}

/// The endpoints that serve cluster traffic, as kube-proxy picks them: the
/// ready ones; when none is ready, the serving-terminating ones, so a rolling
/// update never leaves a window with nothing to answer.
fn select_endpoints(
    slices: &[&EndpointSlice],
    port_name: &str,
    proto: u8,
    config: &ModelConfig,
    errors: &mut Vec<ObjectError>,
) -> Vec<DesiredBackend> {
    // Keyed by address and port: the same endpoint in two slices counts once.
    let mut all: BTreeMap<(IpAddr, u16), DesiredBackend> = BTreeMap::new();
    for slice in slices {
        if slice.address_type != "IPv4" {
            continue;
        }
        let slice_name = || {
            format!(
                "endpointslice {}/{}",
                slice.metadata.namespace.as_deref().unwrap_or("default"),
                slice.metadata.name.as_deref().unwrap_or("?")
            )
        };
        // The slice's port carries the resolved targetPort (named ports included).
        let Some(port) = slice.ports.iter().flatten().find(|p| {
            p.name.as_deref().unwrap_or("") == port_name && protocol_of(p.protocol.as_deref()) == Some(proto)
        }) else {
            continue;
        };
        let Some(port_num) = port.port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0) else {
            errors.push(ObjectError { object: slice_name(), reason: format!("port {port_name:?}: missing or out of range; skipped") });
            continue;
        };
        for ep in &slice.endpoints {
            let Some(addr) = ep.addresses.first() else { continue };
            let Ok(addr) = addr.parse::<IpAddr>() else {
                errors.push(ObjectError { object: slice_name(), reason: format!("invalid endpoint address {addr:?}; skipped") });
                continue;
            };
            let backend = DesiredBackend { addr, port: port_num, proto, flags: endpoint_flags(ep, config) };
            all.entry((addr, port_num))
                .and_modify(|b| b.flags |= backend.flags)
                .or_insert(backend);
        }
    }
    let ready: Vec<DesiredBackend> = all.values().filter(|b| b.flags & BACKEND_READY != 0).copied().collect();
    if !ready.is_empty() {
        return ready;
    }
    all.values()
        .filter(|b| b.flags & BACKEND_SERVING != 0 && b.flags & BACKEND_TERMINATING != 0)
        .copied()
        .collect()
}

/// A Kubernetes protocol name (unset means TCP) as an IP protocol number.
fn protocol_of(p: Option<&str>) -> Option<u8> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(IPPROTO_TCP),
        "UDP" => Some(IPPROTO_UDP),
        "SCTP" => Some(IPPROTO_SCTP),
        _ => None,
    }
}

/// Conditions as the EndpointSlice API defines their defaults: ready unset
/// means ready, serving unset means "as ready", terminating unset means no.
fn endpoint_flags(ep: &Endpoint, config: &ModelConfig) -> u8 {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let serving = c.and_then(|c| c.serving).unwrap_or(ready);
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let local = !config.node_name.is_empty() && ep.node_name.as_deref() == Some(config.node_name.as_str());
    let mut flags = 0;
    if ready {
        flags |= BACKEND_READY;
    }
    if serving {
        flags |= BACKEND_SERVING;
    }
    if terminating {
        flags |= BACKEND_TERMINATING;
    }
    if local {
        flags |= BACKEND_LOCAL;
    }
    flags
}

/// Every distinct backend (address, port, protocol) in the state, in order,
/// with the union of its states across the sets it is in.
pub fn backend_states(state: &DesiredState) -> BTreeMap<(IpAddr, u16, u8), u8> {
    let mut states = BTreeMap::new();
    for b in state.backend_sets.values().flatten() {
        *states.entry((b.addr, b.port, b.proto)).or_default() |= b.flags;
    }
    states
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{self, Object};

    fn snapshot(yaml: &str) -> Snapshot {
        let mut snap = Snapshot::default();
        for obj in manifest::parse(std::path::Path::new("t.yaml"), yaml).unwrap() {
            match obj {
                Object::Service(s) => snap.services.push(*s),
                Object::EndpointSlice(s) => snap.slices.push(*s),
                Object::Node(n) => snap.node = Some(*n),
            }
        }
        snap
    }

    fn cfg() -> ModelConfig {
        ModelConfig { node_name: "node-a".into() }
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
        let (state, errors) = build(&snapshot(WEB), &cfg());
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(backends_of(&state, "shop/web:http"), ["10.244.0.11:8080", "10.244.0.13:8080"]);
        assert_eq!(backends_of(&state, "shop/web:dns"), ["10.244.0.11:5353", "10.244.0.13:5353"]);
        let key = FrontendKey {
            addr: Addr::from("10.96.0.10".parse::<IpAddr>().unwrap()),
            port: 80u16.to_be(),
            proto: IPPROTO_TCP,
            scope: SCOPE_INTERNAL,
        };
        assert_eq!(state.frontends[&key].set.service.to_string(), "shop/web:http");
        assert_eq!(state.frontends.len(), 2);
        let local = state.backend_sets.values().flatten().find(|b| b.addr.to_string() == "10.244.0.11").unwrap();
        assert_ne!(local.flags & BACKEND_LOCAL, 0);
    }

    #[test]
    fn no_ready_endpoint_falls_back_to_serving_terminating() {
        let yaml = WEB.replace(
            "- {addresses: [10.244.0.13]}\n- {addresses: [10.244.0.11]}",
            "- {addresses: [10.244.0.13], conditions: {ready: false, serving: true, terminating: true}}",
        )
        .replace("- {addresses: [10.244.0.11], nodeName: node-a}\n", "");
        let (state, _) = build(&snapshot(&yaml), &cfg());
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
        let (state, errors) = build(&snapshot(yaml), &cfg());
        let names: Vec<String> = state.frontends.values().map(|f| f.set.service.to_string()).collect();
        assert_eq!(names, ["a/badport:c"]);
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
        let (state, errors) = build(&snapshot(yaml), &cfg());
        assert!(errors.is_empty(), "{errors:?}");
        let addr = Addr::from("10.96.0.30".parse::<IpAddr>().unwrap());
        let sctp = FrontendKey { addr, port: 2905u16.to_be(), proto: IPPROTO_SCTP, scope: SCOPE_INTERNAL };
        assert_eq!(state.frontends[&sctp].set.service.to_string(), "tel/sig:m3ua");
        assert_eq!(state.frontends.len(), 2);
        let set = &state.backend_sets[&state.frontends[&sctp].set];
        let got: Vec<(String, u16, u8)> = set.iter().map(|b| (b.addr.to_string(), b.port, b.proto)).collect();
        assert_eq!(got, [("10.244.0.21".to_string(), 3905, IPPROTO_SCTP)]);
    }

    #[test]
    fn service_without_endpoints_has_an_empty_set() {
        let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: lonely, namespace: a}\nspec: {clusterIP: 10.96.0.9, ports: [{port: 80}]}\n";
        let (state, _) = build(&snapshot(yaml), &cfg());
        assert_eq!(state.frontends.len(), 1);
        assert!(state.backend_sets.values().all(Vec::is_empty));
    }
}
