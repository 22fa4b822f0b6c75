//! The policy: a pure function from Services, EndpointSlices, the node and
//! ServiceCIDRs to the frontends, backend sets and service CIDRs the
//! datapath should hold. The BPF side only executes what is decided here, so
//! this is where behaviour is tested.
//!
//! - `group`: the snapshot's objects by Service;
//! - `frontends`: a Service's frontends, their flags and backend sets;
//! - `endpoints`: which of a service port's endpoints serve (kube-proxy's
//!   CategorizeEndpoints, topology, validation);
//! - `node`: whether this node may receive load-balanced traffic;
//! - `algorithm`: how a Service's new flows pick a backend;
//! - `desired`: what the model outputs;
//! - `skip`: what it reports for what it could not use;
//! - `trigger_times`: when the changes it is given happened.

mod algorithm;
mod desired;
mod endpoints;
mod frontends;
mod group;
pub mod node;
mod skip;
pub mod trigger_times;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, HashMap, hash_map},
    net::IpAddr,
};

use ipnet::IpNet;
use proxy_common::FrontendKey;

pub use self::{
    algorithm::{LB_ALGORITHM_ANNOTATION, LbAlgorithm},
    desired::{
        BackendSetKey, BackendTuple, DesiredBackend, DesiredFrontend, DesiredState, HealthCheck, ServicePortName,
        Share, backend_states,
    },
    endpoints::endpoint_flags,
    group::{
        Grouped, SERVICE_NAME_LABEL, ServiceKey, duplicate_service, group, orphan_slice, service_key, slice_owner,
        unlabelled_slice,
    },
    skip::{ObjectError, ObjectKind, SkipReason},
};
pub use self::frontends::build_part;
use crate::{
    precedence::{self, Claim},
    service_cidrs,
    source::Snapshot,
    topology,
};

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
    /// `--lb-algorithm`: for Services without the annotation (`algorithm`).
    pub lb_algorithm: LbAlgorithm,
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
        state.maglev.extend(part.maglev);
        // Services come in namespace/name order: the first claim holds a port.
        for (port, check) in part.health_checks {
            state.health_checks.entry(port).or_insert(check);
        }
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
