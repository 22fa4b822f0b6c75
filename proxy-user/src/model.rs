//! The policy: a pure function from Services, EndpointSlices, the node and
//! ServiceCIDRs to the frontends, backend sets and service CIDRs the
//! datapath should hold. The BPF side only executes what is decided here, so
//! this is where behaviour is tested.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, hash_map},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use k8s_openapi::api::{
    core::v1::{LoadBalancerIngress, Service, ServiceSpec},
    discovery::v1::{Endpoint, EndpointSlice},
};
use proxy_common::{
    Addr, BACKEND_LOCAL, BACKEND_READY, BACKEND_SERVING, BACKEND_TERMINATING, FrontendKey, IPPROTO_SCTP,
    IPPROTO_TCP, IPPROTO_UDP, KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER, KIND_NODE_PORT,
    POLICY_CLUSTER, POLICY_LOCAL, SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_DROP_IF_EMPTY, SVC_MASQUERADE,
    SVC_SOURCE_RANGES,
};

use crate::{
    endpoint_ips,
    precedence::{self, Claim},
    service_cidrs,
    source::Snapshot,
    topology::{self, Hints},
};

/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// kube-proxy's default for sessionAffinityConfig.clientIP.timeoutSeconds.
const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelConfig {
    pub node_name: String,
    /// The node's addresses; NodePorts open on those inside
    /// `node_port_addresses` (all of them when that is empty).
    pub node_addresses: Vec<IpAddr>,
    pub node_port_addresses: Vec<IpNet>,
    /// --cluster-cidr given: sources outside it reaching a ClusterIP are
    /// masqueraded, as kube-proxy's local-traffic detector does.
    pub detect_local: bool,
    pub masquerade_all: bool,
    /// NodePorts on 127.0.0.1 for the node's own processes, as kube-proxy's
    /// `--iptables-localhost-nodeports` (only where `node_port_addresses`
    /// admits 127.0.0.1).
    pub localhost_node_ports: bool,
    /// `--service-cidr`: the service CIDRs where the cluster has no
    /// ServiceCIDR object (see `service_cidrs`).
    pub service_cidrs: Vec<IpNet>,
}

impl ModelConfig {
    fn admits_node_port_on(&self, ip: &IpAddr) -> bool {
        self.node_port_addresses.is_empty() || self.node_port_addresses.iter().any(|net| net.contains(ip))
    }

    /// The node addresses NodePorts (and healthCheckNodePorts) are served on.
    pub fn node_port_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.node_addresses.iter().copied().filter(|ip| self.admits_node_port_on(ip))
    }

    /// 127.0.0.1, when NodePorts are open there.
    fn localhost_node_port_ip(&self) -> Option<IpAddr> {
        let localhost = IpAddr::from([127, 0, 0, 1]);
        (self.localhost_node_ports && self.admits_node_port_on(&localhost)).then_some(localhost)
    }
}

/// `namespace/name:port-name`, as kube-proxy prints a service port.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
    /// The IPv6 half of a Service: its own backend set (IPv6 endpoints for
    /// IPv6 frontends), as kube-proxy runs one proxier per family.
    pub ipv6: bool,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        if self.ipv6 {
            write!(f, " (IPv6)")?;
        }
        Ok(())
    }
}

/// One backend set: a service port's endpoints under one endpoint policy
/// (POLICY_CLUSTER: every usable endpoint; POLICY_LOCAL: this node's).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSetKey {
    pub service: ServicePortName,
    pub policy: u8,
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
    /// SVC_* flags.
    pub flags: u8,
    pub affinity_timeout_s: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Sorted and free of duplicates, so equal inputs give equal slots.
    pub backend_sets: BTreeMap<BackendSetKey, Vec<DesiredBackend>>,
    pub frontends: BTreeMap<FrontendKey, DesiredFrontend>,
    /// Every ClusterIP in use: a port it does not serve is rejected.
    pub cluster_ips: BTreeSet<IpAddr>,
    /// loadBalancerSourceRanges, by the backend set their frontends use.
    pub source_ranges: BTreeMap<BackendSetKey, Vec<IpNet>>,
    /// Every distinct backend in `backend_sets`, with the union of its flags
    /// across the sets it is in (`backend_states`).
    pub backends: BTreeMap<BackendTuple, u8>,
    /// Where an address no Service owns is dropped (`service_cidrs::effective`).
    pub service_cidrs: BTreeSet<IpNet>,
}

/// A backend's identity: address, port, IP protocol.
pub type BackendTuple = (IpAddr, u16, u8);

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

/// A Service's `(namespace, name)`, borrowed from the snapshot.
pub type ServiceKey<'a> = (&'a str, &'a str);

/// A snapshot's objects by Service: the one Service object of each
/// `namespace/name` (the last, if the snapshot holds several), the
/// EndpointSlices labelled for it, and what could not be tied to a Service.
pub struct Grouped<'a> {
    pub services: BTreeMap<ServiceKey<'a>, &'a Arc<Service>>,
    pub slices: HashMap<ServiceKey<'a>, Vec<&'a Arc<EndpointSlice>>>,
    pub errors: Vec<ObjectError>,
}

pub fn group(snapshot: &Snapshot) -> Grouped<'_> {
    let mut errors = Vec::new();
    let mut slices: HashMap<ServiceKey, Vec<&Arc<EndpointSlice>>> = HashMap::new();
    for slice in &snapshot.slices {
        match slice_owner(slice) {
            Some(key) => slices.entry(key).or_default().push(slice),
            None => errors.push(unlabelled_slice(slice)),
        }
    }
    let mut services = BTreeMap::new();
    for svc in &snapshot.services {
        let key = service_key(svc);
        if services.insert(key, svc).is_some() {
            errors.push(duplicate_service(key));
        }
    }
    let mut orphans: Vec<(&ServiceKey, &Vec<&Arc<EndpointSlice>>)> =
        slices.iter().filter(|(key, _)| !services.contains_key(*key)).collect();
    orphans.sort_by_key(|(key, _)| **key);
    for (key, list) in orphans {
        errors.extend(list.iter().map(|slice| orphan_slice(*key, slice)));
    }
    Grouped { services, slices, errors }
}

/// The key of the Service a slice belongs to, from its label.
pub fn slice_owner(slice: &EndpointSlice) -> Option<ServiceKey<'_>> {
    let ns = slice.metadata.namespace.as_deref().unwrap_or("default");
    slice.metadata.labels.as_ref().and_then(|l| l.get(SERVICE_NAME_LABEL)).map(|svc| (ns, svc.as_str()))
}

pub fn service_key(svc: &Service) -> ServiceKey<'_> {
    (svc.metadata.namespace.as_deref().unwrap_or("default"), svc.metadata.name.as_deref().unwrap_or(""))
}

fn slice_name(slice: &EndpointSlice) -> String {
    let ns = slice.metadata.namespace.as_deref().unwrap_or("default");
    format!("endpointslice {ns}/{}", slice.metadata.name.as_deref().unwrap_or("?"))
}

pub fn unlabelled_slice(slice: &EndpointSlice) -> ObjectError {
    ObjectError { object: slice_name(slice), reason: format!("no {SERVICE_NAME_LABEL} label; ignored") }
}

pub fn duplicate_service(key: ServiceKey) -> ObjectError {
    ObjectError {
        object: format!("service {}/{}", key.0, key.1),
        reason: "defined more than once; the last definition is used".into(),
    }
}

pub fn orphan_slice(key: ServiceKey, slice: &EndpointSlice) -> ObjectError {
    ObjectError { object: slice_name(slice), reason: format!("no such service {}/{}; ignored until it exists", key.0, key.1) }
}

/// One Service's share of the desired state (its frontends, backend sets,
/// ClusterIPs and source ranges; `backends` left empty) and what in it was
/// skipped. `service_cidrs` are the effective ones: no endpoint is in them.
pub fn build_part(
    key: ServiceKey,
    svc: &Service,
    slices: &[&Arc<EndpointSlice>],
    config: &ModelConfig,
    zone: &str,
    service_cidrs: &BTreeSet<IpNet>,
) -> (DesiredState, Vec<ObjectError>) {
    let mut state = DesiredState::default();
    let mut errors = Vec::new();
    let slices: Vec<&EndpointSlice> = slices.iter().map(|s| &***s).collect();
    let mut ctx = ServiceCtx { ns: key.0.to_string(), name: key.1.to_string(), zone, service_cidrs, errors: &mut errors };
    build_service(svc, &slices, config, &mut ctx, &mut state);
    (state, errors)
}

/// The whole desired state from scratch. The agent keeps it up to date with
/// `incremental::Model` instead; this is the reference it is tested against.
/// A frontend several Services claim goes to one of them by `precedence`;
/// each other claim is reported.
pub fn build(snapshot: &Snapshot, config: &ModelConfig) -> (DesiredState, Vec<ObjectError>) {
    let mut state = DesiredState::default();
    let grouped = group(snapshot);
    let mut errors = grouped.errors;
    let (cidrs, cidr_errors) = service_cidrs::effective(&snapshot.service_cidrs, &config.service_cidrs);
    state.service_cidrs = cidrs;
    errors.extend(cidr_errors);
    let zone = topology::node_zone(snapshot.node.as_ref());
    // The claim each frontend is served by, and every claim on those more
    // than one Service claims.
    let mut holders: HashMap<FrontendKey, Claim> = HashMap::new();
    let mut contested: BTreeMap<FrontendKey, Vec<Claim>> = BTreeMap::new();
    for (key, svc) in &grouped.services {
        let slices = grouped.slices.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let (part, part_errors) = build_part(*key, svc, slices, config, zone, &state.service_cidrs);
        errors.extend(part_errors);
        state.backend_sets.extend(part.backend_sets);
        state.source_ranges.extend(part.source_ranges);
        state.cluster_ips.extend(part.cluster_ips);
        for (fk, fe) in part.frontends {
            let claim = Claim::new(fe.kind, svc, *key);
            match holders.entry(fk) {
                hash_map::Entry::Vacant(free) => {
                    free.insert(claim);
                    state.frontends.insert(fk, fe);
                }
                hash_map::Entry::Occupied(mut held) => {
                    let holder = *held.get();
                    contested.entry(fk).or_insert_with(|| vec![holder]).push(claim);
                    if claim < holder {
                        held.insert(claim);
                        state.frontends.insert(fk, fe);
                    }
                }
            }
        }
    }
    let mut conflicts = Vec::new();
    for (fk, claims) in &contested {
        precedence::report_losers(fk, claims, &mut conflicts);
    }
    errors.extend(conflicts);
    state.backends = backend_states(&state);
    (state, errors)
}

struct ServiceCtx<'a> {
    ns: String,
    name: String,
    /// This node's zone, for topology hints.
    zone: &'a str,
    /// The effective service CIDRs, where no endpoint can be.
    service_cidrs: &'a BTreeSet<IpNet>,
    errors: &'a mut Vec<ObjectError>,
}

impl ServiceCtx<'_> {
    fn skip(&mut self, reason: String) {
        let error = ObjectError { object: format!("service {}/{}", self.ns, self.name), reason };
        // A dual-stack Service is built once per family: report once.
        if !self.errors.contains(&error) {
            self.errors.push(error);
        }
    }

    /// Valid addresses of a list, of the family being built (`ipv6`).
    fn ips<'s>(&mut self, field: &str, ips: impl IntoIterator<Item = &'s String>, ipv6: bool) -> Vec<IpAddr> {
        let mut out = Vec::new();
        for ip in ips {
            match ip.trim().parse::<IpAddr>() {
                Ok(ip) if ip.is_ipv6() == ipv6 => out.push(ip),
                Ok(_) => {}
                Err(_) => self.skip(format!("{field}: invalid IP {ip:?}; that address is skipped")),
            }
        }
        out
    }
}

fn build_service(svc: &Service, slices: &[&EndpointSlice], config: &ModelConfig, ctx: &mut ServiceCtx, state: &mut DesiredState) {
    let Some(spec) = &svc.spec else {
        ctx.skip("no spec; skipped".into());
        return;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return;
    }
    let ips: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => vec![],
    };
    if ips.iter().any(|ip| ip.as_str() == "None") {
        return; // headless: DNS only, nothing to proxy
    }
    // A dual-stack Service is two: each family's frontends lead to that
    // family's endpoints only.
    for ipv6 in [false, true] {
        build_family(svc, spec, &ips, slices, config, ctx, state, ipv6);
    }
}

#[allow(clippy::too_many_arguments)]
fn build_family(
    svc: &Service,
    spec: &ServiceSpec,
    ips: &[&String],
    slices: &[&EndpointSlice],
    config: &ModelConfig,
    ctx: &mut ServiceCtx,
    state: &mut DesiredState,
    ipv6: bool,
) {
    let cluster_ips = ctx.ips("spec.clusterIPs", ips.iter().copied(), ipv6);
    if cluster_ips.is_empty() {
        return;
    }
    state.cluster_ips.extend(&cluster_ips);
    let external_ips = ctx.ips("spec.externalIPs", spec.external_ips.iter().flatten(), ipv6);
    let lb_ips = {
        let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|lb| lb.ingress.as_ref());
        let vips = ingress.into_iter().flatten().enumerate().filter(|(i, ing)| is_vip_mode(*i, ing, ctx));
        let ips: Vec<&String> = vips.filter_map(|(_, ing)| ing.ip.as_ref()).collect();
        ctx.ips("status.loadBalancer.ingress", ips, ipv6)
    };
    let source_ranges = admit_lb_ips_if_node_admitted(parse_source_ranges(spec, ctx, ipv6), &lb_ips, &config.node_addresses);
    let policy = TrafficPolicy::of(spec);

    for (i, port) in spec.ports.iter().flatten().enumerate() {
        let Some(proto) = protocol_of(port.protocol.as_deref()) else {
            ctx.skip(format!("spec.ports[{i}]: unknown protocol {:?}; port skipped", port.protocol));
            continue;
        };
        let Some(port_num) = port_number(port.port) else {
            ctx.skip(format!("spec.ports[{i}].port: {} out of range; port skipped", port.port));
            continue;
        };
        let service = ServicePortName { namespace: ctx.ns.clone(), name: ctx.name.clone(), port: port.name.clone().unwrap_or_default(), ipv6 };
        let (all, hints) = select_endpoints(slices, &service.port, proto, ipv6, config, ctx.service_cidrs, ctx.errors);
        let endpoints = categorize(&all, policy.uses_local(), &hints, &config.node_name, ctx.zone);
        let externally_accessible = port.node_port.is_some() || !external_ips.is_empty() || !lb_ips.is_empty();

        let cluster = BackendSetKey { service: service.clone(), policy: POLICY_CLUSTER };
        let local = BackendSetKey { service, policy: POLICY_LOCAL };
        let affinity_timeout_s = affinity_timeout(spec);
        let (mut has_cluster, mut has_local) = (false, false);
        let mut add = |state: &mut DesiredState, key: FrontendKey, set: &BackendSetKey, kind: u8, mut flags: u8, empty: bool| {
            // The Service's own ClusterIP listed again as its ExternalIP (or
            // LB IP) stays a ClusterIP, as between two Services.
            if state.frontends.get(&key).is_some_and(|held| precedence::rank(held.kind) < precedence::rank(kind)) {
                return;
            }
            if set.policy == POLICY_LOCAL { has_local = true } else { has_cluster = true }
            // Endpoints elsewhere but none for this policy: kube-proxy drops;
            // no endpoint at all: it rejects.
            if empty && endpoints.any {
                flags |= SVC_DROP_IF_EMPTY;
            }
            state.frontends.insert(key, DesiredFrontend { set: set.clone(), kind, flags, affinity_timeout_s });
        };

        // ClusterIP: internalTrafficPolicy for every source; sources outside
        // the cluster CIDR are masqueraded so replies come back through us.
        let internal_set = if policy.internal_local { &local } else { &cluster };
        let internal_empty = if policy.internal_local { endpoints.local.is_empty() } else { endpoints.cluster.is_empty() };
        for ip in &cluster_ips {
            let fk = |scope| FrontendKey { addr: Addr::from(*ip), port: port_num.to_be(), proto, scope };
            let all = if config.masquerade_all { SVC_MASQUERADE } else { 0 };
            add(state, fk(SCOPE_INTERNAL), internal_set, KIND_CLUSTER_IP, all, internal_empty);
            let outside = if config.detect_local { SVC_MASQUERADE } else { all };
            add(state, fk(SCOPE_EXTERNAL), internal_set, KIND_CLUSTER_IP, outside, internal_empty);
        }

        // NodePort, ExternalIPs, LoadBalancer IPs: externalTrafficPolicy.
        // Cluster masquerades every source (the endpoint may be on another
        // node). Local keeps the client address and uses only this node's
        // endpoints, except for pods and the node itself, which short-circuit
        // to the internal set as if they had gone out to the load balancer
        // and back.
        if externally_accessible {
            let mut frontends: Vec<(FrontendKey, u8, u8)> = Vec::new();
            let key = |addr: IpAddr, port: u16, scope| FrontendKey { addr: Addr::from(addr), port: port.to_be(), proto, scope };
            if let Some(node_port) = port.node_port.and_then(port_number) {
                for ip in config.node_port_ips().filter(|ip| ip.is_ipv6() == ipv6) {
                    frontends.push((key(ip, node_port, SCOPE_INTERNAL), KIND_NODE_PORT, 0));
                    frontends.push((key(ip, node_port, SCOPE_EXTERNAL), KIND_NODE_PORT, 0));
                }
                // Only the node's processes can dial 127.0.0.1 (socket hooks).
                // kube-proxy opens no NodePort on ::1.
                if let Some(ip) = config.localhost_node_port_ip().filter(|_| !ipv6) {
                    frontends.push((key(ip, node_port, SCOPE_INTERNAL), KIND_NODE_PORT, 0));
                }
            }
            for ip in &external_ips {
                frontends.push((key(*ip, port_num, SCOPE_INTERNAL), KIND_EXTERNAL_IP, 0));
                frontends.push((key(*ip, port_num, SCOPE_EXTERNAL), KIND_EXTERNAL_IP, 0));
            }
            let ranges = if source_ranges.is_empty() { 0 } else { SVC_SOURCE_RANGES };
            for ip in &lb_ips {
                frontends.push((key(*ip, port_num, SCOPE_INTERNAL), KIND_LOAD_BALANCER, ranges));
                frontends.push((key(*ip, port_num, SCOPE_EXTERNAL), KIND_LOAD_BALANCER, ranges));
            }
            for (fk, kind, flags) in frontends {
                if !policy.external_local {
                    add(state, fk, &cluster, kind, flags | SVC_MASQUERADE, endpoints.cluster.is_empty());
                } else if fk.scope == SCOPE_INTERNAL {
                    // Pods (per --cluster-cidr) and the node's own processes
                    // (socket hooks), which kube-proxy short-circuits too.
                    let (set, empty) = if policy.internal_local { (&local, endpoints.local.is_empty()) } else { (&cluster, endpoints.cluster.is_empty()) };
                    add(state, fk, set, kind, flags, empty);
                } else {
                    add(state, fk, &local, kind, flags, endpoints.local.is_empty());
                }
            }
            if !source_ranges.is_empty() {
                for set in [&cluster, &local] {
                    state.source_ranges.insert(set.clone(), source_ranges.clone());
                }
            }
        }
        if !has_local {
            state.source_ranges.remove(&local);
        }
        if has_cluster {
            state.backend_sets.insert(cluster.clone(), endpoints.cluster);
        } else {
            state.source_ranges.remove(&cluster);
        }
        if has_local {
            state.backend_sets.insert(local, endpoints.local);
        }
    }
}

/// Whether a load balancer ingress IP is one to serve (KEP-1860, as
/// kube-proxy's IsVIPMode): `ipMode: VIP`, or none, means the load balancer
/// delivers packets still addressed to that IP; `Proxy` means it delivers
/// them to the node or pod address itself, so the IP gets no frontend and a
/// client in the cluster dialling it reaches the real load balancer.
fn is_vip_mode(index: usize, ingress: &LoadBalancerIngress, ctx: &mut ServiceCtx) -> bool {
    match ingress.ip_mode.as_deref() {
        None | Some("VIP") => true,
        Some("Proxy") => false,
        // The API server refuses other values; a manifest may still hold one.
        Some(other) => {
            ctx.skip(format!("status.loadBalancer.ingress[{index}].ipMode: unknown mode {other:?}; that address is skipped"));
            false
        }
    }
}

/// A port number as the API gives it (i32), if it is a valid one.
fn port_number(p: i32) -> Option<u16> {
    u16::try_from(p).ok().filter(|p| *p != 0)
}

#[derive(Debug, Clone, Copy)]
struct TrafficPolicy {
    internal_local: bool,
    external_local: bool,
}

impl TrafficPolicy {
    fn of(spec: &ServiceSpec) -> Self {
        TrafficPolicy {
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            external_local: spec.external_traffic_policy.as_deref() == Some("Local"),
        }
    }

    fn uses_local(&self) -> bool {
        self.internal_local || self.external_local
    }
}

fn affinity_timeout(spec: &ServiceSpec) -> u32 {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return 0;
    }
    let configured = spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref()).and_then(|c| c.timeout_seconds);
    configured.and_then(|t| u32::try_from(t).ok()).filter(|t| *t > 0).unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S)
}

/// loadBalancerSourceRanges; like kube-proxy, surrounding spaces are
/// tolerated and an invalid entry is skipped (with a report), not fatal.
fn parse_source_ranges(spec: &ServiceSpec, ctx: &mut ServiceCtx, ipv6: bool) -> Vec<IpNet> {
    let mut out = Vec::new();
    for (i, r) in spec.load_balancer_source_ranges.iter().flatten().enumerate() {
        match r.trim().parse::<IpNet>() {
            Ok(net) if net.addr().is_ipv6() == ipv6 => out.push(net.trunc()),
            Ok(_) => {}
            Err(_) => ctx.skip(format!("spec.loadBalancerSourceRanges[{i}]: invalid CIDR {r:?}; skipped")),
        }
    }
    out
}

/// kube-proxy's rule for a node reaching its own load balancer: the cloud LB
/// hands that connection back SNATted to the LB IP, so ranges that admit a
/// node address admit the LB IPs as sources too.
fn admit_lb_ips_if_node_admitted(mut ranges: Vec<IpNet>, lb_ips: &[IpAddr], node_addresses: &[IpAddr]) -> Vec<IpNet> {
    if ranges.iter().any(|net| node_addresses.iter().any(|ip| net.contains(ip))) {
        ranges.extend(lb_ips.iter().map(|ip| IpNet::from(*ip)));
    }
    ranges
}

/// kube-proxy's CategorizeEndpoints: the cluster set (ready and in this
/// node's topology, else serving-terminating), the local set (this node's ready, else its
/// serving-terminating) and whether any endpoint is usable at all.
struct Categorized {
    cluster: Vec<DesiredBackend>,
    local: Vec<DesiredBackend>,
    any: bool,
}

fn categorize(
    all: &[DesiredBackend],
    uses_local: bool,
    hints: &BTreeMap<(IpAddr, u16), Hints>,
    node_name: &str,
    zone: &str,
) -> Categorized {
    let ready = |b: &&DesiredBackend| b.flags & BACKEND_READY != 0;
    let serving_terminating = |b: &&DesiredBackend| b.flags & BACKEND_SERVING != 0 && b.flags & BACKEND_TERMINATING != 0;
    let is_local = |b: &&DesiredBackend| b.flags & BACKEND_LOCAL != 0;
    let pick = |f: &dyn Fn(&&DesiredBackend) -> bool| all.iter().filter(f).copied().collect::<Vec<_>>();
    let no_hints = Hints::default();
    let hints_of = |b: &DesiredBackend| hints.get(&(b.addr, b.port)).unwrap_or(&no_hints);
    let mode = topology::mode(all.iter().filter(ready).map(hints_of), node_name, zone);
    let mut cluster = pick(&|b| ready(b) && topology::available(hints_of(b), mode, node_name, zone));
    if cluster.is_empty() {
        cluster = pick(&serving_terminating);
    }
    let mut local = Vec::new();
    if uses_local {
        local = pick(&|b| is_local(b) && ready(b));
        if local.is_empty() {
            local = pick(&|b| is_local(b) && serving_terminating(b));
        }
    }
    let any = all.iter().any(|b| ready(&b) || serving_terminating(&b));
    Categorized { cluster, local, any }
}

/// Every endpoint of a service port, once (by address and port), with its
/// conditions as flags, and its topology hints; `categorize` decides which
/// ones serve. Addresses that cannot be endpoints (`endpoint_ips`) are
/// skipped, the rest of their slice kept.
fn select_endpoints(
    slices: &[&EndpointSlice],
    port_name: &str,
    proto: u8,
    ipv6: bool,
    config: &ModelConfig,
    service_cidrs: &BTreeSet<IpNet>,
    errors: &mut Vec<ObjectError>,
) -> (Vec<DesiredBackend>, BTreeMap<(IpAddr, u16), Hints>) {
    let mut hints: BTreeMap<(IpAddr, u16), Hints> = BTreeMap::new();
    // Which slice listed each endpoint first, to report it listed again elsewhere.
    let mut listed_in: BTreeMap<(IpAddr, u16), &str> = BTreeMap::new();
    // Keyed by address and port: the same endpoint in two slices counts once.
    let mut all: BTreeMap<(IpAddr, u16), DesiredBackend> = BTreeMap::new();
    for slice in slices {
        // FQDN slices (deprecated) are not proxied, as in kube-proxy.
        if slice.address_type != if ipv6 { "IPv6" } else { "IPv4" } {
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
            // A bad address is reported once, not once per service port.
            let mut skip = |reason: String| {
                let error = ObjectError { object: slice_name(), reason };
                if !errors.contains(&error) {
                    errors.push(error);
                }
            };
            let addr = match addr.parse::<IpAddr>() {
                Ok(ip) if ip.is_ipv6() == ipv6 => ip,
                Ok(_) => {
                    skip(format!("endpoint address {addr} is not of the slice's addressType {}; skipped", slice.address_type));
                    continue;
                }
                Err(_) => {
                    skip(format!("invalid endpoint address {addr:?}; skipped"));
                    continue;
                }
            };
            if let Some(why) = endpoint_ips::refused(addr, service_cidrs) {
                skip(format!("endpoint address {addr} refused: {why}; skipped"));
                continue;
            }
            let backend = DesiredBackend { addr, port: port_num, proto, flags: endpoint_flags(ep, config) };
            let this_slice = slice.metadata.name.as_deref().unwrap_or("?");
            let first = *listed_in.entry((addr, port_num)).or_insert(this_slice);
            if first != this_slice {
                errors.push(ObjectError {
                    object: slice_name(),
                    reason: format!("endpoint {addr}:{port_num} duplicates one in endpointslice {first}; counted once"),
                });
            }
            all.entry((addr, port_num))
                .and_modify(|b| b.flags |= backend.flags)
                .or_insert(backend);
            hints.entry((addr, port_num)).or_default().merge(&Hints::of(ep));
        }
    }
    (all.into_values().collect(), hints)
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
pub(crate) fn endpoint_flags(ep: &Endpoint, config: &ModelConfig) -> u8 {
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
pub fn backend_states(state: &DesiredState) -> BTreeMap<BackendTuple, u8> {
    let mut states = BTreeMap::new();
    for b in state.backend_sets.values().flatten() {
        *states.entry((b.addr, b.port, b.proto)).or_default() |= b.flags;
    }
    states
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
