//! What the model decides: the frontends, backend sets, ClusterIPs, source
//! ranges and service CIDRs the datapath should hold.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use proxy_common::FrontendKey;

/// `namespace/name:port-name`, as kube-proxy prints a service port. Each
/// frontend and backend set, in every share and in the sum, names its
/// service port: the names are shared (`Arc`), not copied (at 10,000
/// Services the copies were 300,000 allocations).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
    pub port: Arc<str>,
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
    /// The healthCheckNodePorts this node answers (externalTrafficPolicy
    /// Local), by port; a port two Services claim (the API forbids it) goes
    /// to the first by namespace/name.
    pub health_checks: BTreeMap<u16, HealthCheck>,
    /// The backend sets balanced by Maglev (their frontends carry
    /// SVC_MAGLEV): each gets a table while it has backends.
    pub maglev: BTreeSet<BackendSetKey>,
}

impl DesiredState {
    /// Whether `set` needs a Maglev table: Maglev, with backends to fill it.
    pub fn wants_maglev_table(&self, set: &BackendSetKey) -> bool {
        self.maglev.contains(set) && self.backend_sets.get(set).is_some_and(|b| !b.is_empty())
    }
}

/// One Service's share of the desired state, as the incremental model
/// keeps it for each Service: `build_part`'s entries in sorted vectors
/// sized to fit. (A BTreeMap node takes about 1.2 KB however few entries it
/// holds, and a Service has a few: at 10,000 Services that was 25 MB.)
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Share {
    pub backend_sets: Vec<(BackendSetKey, Vec<DesiredBackend>)>,
    pub frontends: Vec<(FrontendKey, DesiredFrontend)>,
    pub cluster_ips: Vec<IpAddr>,
    pub source_ranges: Vec<(BackendSetKey, Vec<IpNet>)>,
    pub health_checks: Vec<(u16, HealthCheck)>,
    pub maglev: Vec<BackendSetKey>,
}

impl From<DesiredState> for Share {
    fn from(part: DesiredState) -> Share {
        // A BTreeMap iterates in key order, so each vector is sorted.
        Share {
            backend_sets: part.backend_sets.into_iter().map(|(set, backends)| (set, fit(backends))).collect(),
            frontends: part.frontends.into_iter().collect(),
            cluster_ips: part.cluster_ips.into_iter().collect(),
            source_ranges: part.source_ranges.into_iter().collect(),
            health_checks: part.health_checks.into_iter().collect(),
            maglev: part.maglev.into_iter().collect(),
        }
    }
}

impl Share {
    pub fn frontend(&self, key: &FrontendKey) -> Option<&DesiredFrontend> {
        find(&self.frontends, key)
    }

    pub fn source_ranges_of(&self, set: &BackendSetKey) -> Option<&Vec<IpNet>> {
        find(&self.source_ranges, set)
    }

    pub fn health_check(&self, port: u16) -> Option<&HealthCheck> {
        find(&self.health_checks, &port)
    }

    /// As `DesiredState::wants_maglev_table`.
    pub fn wants_maglev_table(&self, set: &BackendSetKey) -> bool {
        self.maglev.binary_search(set).is_ok() && find(&self.backend_sets, set).is_some_and(|b| !b.is_empty())
    }
}

/// Categorizing collects backends into vectors grown by doubling.
fn fit<T>(mut v: Vec<T>) -> Vec<T> {
    v.shrink_to_fit();
    v
}

fn find<'a, K: Ord, V>(sorted: &'a [(K, V)], key: &K) -> Option<&'a V> {
    sorted.binary_search_by(|(k, _)| k.cmp(key)).ok().map(|i| &sorted[i].1)
}

/// What the server on one healthCheckNodePort answers for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub namespace: String,
    pub name: String,
    /// This node's ready endpoints of the Service, counted by address (an
    /// endpoint serving several ports counts once; one the model refuses,
    /// serving nothing, not at all).
    pub local_endpoints: usize,
}

/// A backend's identity: address, port, IP protocol.
pub type BackendTuple = (IpAddr, u16, u8);

/// Every distinct backend (address, port, protocol) in the state, in order,
/// with the union of its states across the sets it is in.
pub fn backend_states(state: &DesiredState) -> BTreeMap<BackendTuple, u8> {
    let mut states = BTreeMap::new();
    for b in state.backend_sets.values().flatten() {
        *states.entry((b.addr, b.port, b.proto)).or_default() |= b.flags;
    }
    states
}
