//! One Service's frontends (ClusterIPs, NodePorts, ExternalIPs,
//! LoadBalancer IPs) with their flags, affinity and source ranges, and the
//! backend sets they use.

use std::{collections::BTreeSet, net::IpAddr, sync::Arc};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{LoadBalancerIngress, Service, ServiceSpec};
use proxy_common::{
    Addr, BACKEND_LOCAL, BACKEND_READY, FrontendKey, KIND_CLUSTER_IP, KIND_EXTERNAL_IP, KIND_LOAD_BALANCER,
    KIND_NODE_PORT, POLICY_CLUSTER, POLICY_LOCAL, SCOPE_EXTERNAL, SCOPE_INTERNAL, SVC_DROP_IF_EMPTY, SVC_MAGLEV,
    SVC_MASQUERADE, SVC_SOURCE_RANGES,
};

use super::{
    BackendSetKey, DesiredFrontend, DesiredState, HealthCheck, LbAlgorithm, ModelConfig, ObjectError, ServiceKey,
    ServicePortName, SkipReason, algorithm,
    endpoints::{categorize, endpoint_flags, protocol_of, select_endpoints},
};
use crate::{endpoint_ips, endpoint_slice::EndpointSlice, precedence};

/// kube-proxy's default for sessionAffinityConfig.clientIP.timeoutSeconds.
pub(super) const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

/// One Service's share of the desired state (its frontends, backend sets,
/// ClusterIPs, source ranges and health check; `backends` left empty) and what in it was
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
    let mut ctx = ServiceCtx { ns: key.0.into(), name: key.1.into(), zone, service_cidrs, errors: &mut errors };
    build_service(svc, &slices, config, &mut ctx, &mut state);
    (state, errors)
}

struct ServiceCtx<'a> {
    ns: Arc<str>,
    name: Arc<str>,
    /// This node's zone, for topology hints.
    zone: &'a str,
    /// The effective service CIDRs, where no endpoint can be.
    service_cidrs: &'a BTreeSet<IpNet>,
    errors: &'a mut Vec<ObjectError>,
}

impl ServiceCtx<'_> {
    fn skip(&mut self, why: SkipReason, reason: String) {
        let error = ObjectError::service(&self.ns, &self.name, why, reason);
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
                Err(_) => self.skip(SkipReason::InvalidIp, format!("{field}: invalid IP {ip:?}; that address is skipped")),
            }
        }
        out
    }
}

fn build_service(svc: &Service, slices: &[&EndpointSlice], config: &ModelConfig, ctx: &mut ServiceCtx, state: &mut DesiredState) {
    let Some(spec) = &svc.spec else {
        ctx.skip(SkipReason::MissingField, "no spec; skipped".into());
        return;
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return;
    }
    if let Some((port, check)) = health_check(spec, slices, config, ctx) {
        state.health_checks.insert(port, check);
    }
    let ips: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => vec![],
    };
    if ips.iter().any(|ip| ip.as_str() == "None") {
        return; // headless: DNS only, nothing to proxy
    }
    let algorithm = algorithm::of(svc, config.lb_algorithm).unwrap_or_else(|why| {
        ctx.skip(SkipReason::UnknownLbAlgorithm, why);
        config.lb_algorithm
    });
    // A dual-stack Service is two: each family's frontends lead to that
    // family's endpoints only.
    for ipv6 in [false, true] {
        build_family(svc, spec, &ips, slices, config, ctx, state, ipv6, algorithm);
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
    algorithm: LbAlgorithm,
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
            ctx.skip(SkipReason::UnknownProtocol, format!("spec.ports[{i}]: unknown protocol {:?}; port skipped", port.protocol));
            continue;
        };
        let Some(port_num) = port_number(port.port) else {
            ctx.skip(SkipReason::PortOutOfRange, format!("spec.ports[{i}].port: {} out of range; port skipped", port.port));
            continue;
        };
        let service = ServicePortName { namespace: ctx.ns.clone(), name: ctx.name.clone(), port: port.name.as_deref().unwrap_or_default().into(), ipv6 };
        let (all, hints) = select_endpoints(slices, &service.port, proto, ipv6, config, ctx.service_cidrs, ctx.errors);
        let endpoints = categorize(&all, policy.uses_local(), &hints, &config.node_name, ctx.zone);
        let externally_accessible = port.node_port.is_some() || !external_ips.is_empty() || !lb_ips.is_empty();

        let cluster = BackendSetKey { service: service.clone(), policy: POLICY_CLUSTER };
        let local = BackendSetKey { service, policy: POLICY_LOCAL };
        let affinity_timeout_s = affinity_timeout(spec);
        let maglev = if algorithm == LbAlgorithm::Maglev { SVC_MAGLEV } else { 0 };
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
            flags |= maglev;
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
            if maglev != 0 {
                state.maglev.insert(cluster.clone());
            }
        } else {
            state.source_ranges.remove(&cluster);
        }
        if has_local {
            if maglev != 0 {
                state.maglev.insert(local.clone());
            }
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
            ctx.skip(SkipReason::UnknownIpMode, format!("status.loadBalancer.ingress[{index}].ipMode: unknown mode {other:?}; that address is skipped"));
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
            Err(_) => ctx.skip(SkipReason::InvalidCidr, format!("spec.loadBalancerSourceRanges[{i}]: invalid CIDR {r:?}; skipped")),
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

/// The health check an externalTrafficPolicy Local Service with a
/// healthCheckNodePort asks of this node: its ready endpoints here, of
/// either family, by address.
fn health_check(spec: &ServiceSpec, slices: &[&EndpointSlice], config: &ModelConfig, ctx: &ServiceCtx) -> Option<(u16, HealthCheck)> {
    if spec.external_traffic_policy.as_deref() != Some("Local") {
        return None;
    }
    let port = spec.health_check_node_port.and_then(|p| u16::try_from(p).ok()).filter(|p| *p != 0)?;
    let mut local = BTreeSet::new();
    for ep in slices.iter().flat_map(|s| &s.endpoints) {
        // Ready only: a node with nothing but terminating endpoints must fail the check.
        let flags = endpoint_flags(ep, config);
        if flags & BACKEND_READY != 0 && flags & BACKEND_LOCAL != 0 {
            let addr = ep.address.as_deref().and_then(|a| a.parse::<IpAddr>().ok());
            local.extend(addr.filter(|ip| endpoint_ips::refused(*ip, ctx.service_cidrs).is_none()));
        }
    }
    Some((port, HealthCheck { namespace: ctx.ns.to_string(), name: ctx.name.to_string(), local_endpoints: local.len() }))
}
