//! The desired state kept up to date as snapshots arrive: only the Services
//! whose objects changed (a Service, or one of its EndpointSlices, is a new
//! object: sources share unchanged objects between snapshots) are rebuilt,
//! and the update says which map keys it touched, so the reconciler looks
//! at those alone. `model::build` is the reference it must always equal.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use proxy_common::FrontendKey;

use crate::{
    model::{self, BackendSetKey, BackendTuple, DesiredState, ModelConfig, ObjectError, ServiceKey},
    source::Snapshot,
    topology,
};

/// The map keys an update may have changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Touched {
    /// Backend sets (their slots, names and source ranges).
    pub sets: BTreeSet<BackendSetKey>,
    pub frontends: BTreeSet<FrontendKey>,
    /// ClusterIPs (their reject-unserved-ports markers).
    pub cluster_ips: BTreeSet<IpAddr>,
    pub backends: BTreeSet<BackendTuple>,
}

impl Touched {
    pub fn is_empty(&self) -> bool {
        self.sets.is_empty() && self.frontends.is_empty() && self.cluster_ips.is_empty() && self.backends.is_empty()
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Update {
    /// Everything was rebuilt (first update, or the node or the config changed).
    Everything,
    Touched(Touched),
}

/// One Service's inputs (compared by pointer) and what they gave.
struct Part {
    service: Arc<Service>,
    slices: Vec<Arc<EndpointSlice>>,
    state: DesiredState,
    errors: Vec<ObjectError>,
}

/// How many backend sets hold a backend, per flag bit: the union of its
/// flags is the bits still counted.
#[derive(Default)]
struct FlagCounts {
    sets: u32,
    bits: [u32; 8],
}

impl FlagCounts {
    fn union(&self) -> u8 {
        (0..8).filter(|b| self.bits[*b] > 0).fold(0, |acc, b| acc | (1 << b))
    }
}

#[derive(Default)]
pub struct Model {
    config: Option<(ModelConfig, String)>,
    /// By `namespace\0name`, which sorts as (namespace, name) does.
    parts: BTreeMap<String, Part>,
    desired: DesiredState,
    /// How many Services claim each frontend and ClusterIP.
    frontend_claims: HashMap<FrontendKey, u32>,
    cluster_ip_claims: HashMap<IpAddr, u32>,
    backend_claims: HashMap<BackendTuple, FlagCounts>,
    /// Errors of the snapshot as a whole (slices without a Service, ...).
    group_errors: Vec<ObjectError>,
}

fn part_key<'b>(buf: &'b mut String, key: ServiceKey) -> &'b str {
    buf.clear();
    buf.push_str(key.0);
    buf.push('\0');
    buf.push_str(key.1);
    buf
}

impl Model {
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// What was skipped, in the order `model::build` reports it.
    pub fn errors(&self) -> Vec<ObjectError> {
        let parts = self.parts.values().flat_map(|p| p.errors.iter());
        self.group_errors.iter().chain(parts).cloned().collect()
    }

    pub fn update(&mut self, snapshot: &Snapshot, config: &ModelConfig) -> Update {
        let zone = topology::node_zone(snapshot.node.as_ref());
        let everything = self.config.as_ref().is_none_or(|(c, z)| c != config || z != zone);
        if everything {
            *self = Model { config: Some((config.clone(), zone.to_string())), ..Default::default() };
        }
        let grouped = model::group(snapshot);
        let mut touched = Touched::default();

        let gone: Vec<String> = self
            .parts
            .keys()
            .filter(|k| k.split_once('\0').is_none_or(|key| !grouped.services.contains_key(&key)))
            .cloned()
            .collect();
        for key in gone {
            let part = self.parts.remove(&key).expect("listed");
            self.retract(&part, &mut touched);
        }
        let mut buf = String::new();
        for (key, svc) in &grouped.services {
            let slices = grouped.slices.get(key).map(Vec::as_slice).unwrap_or(&[]);
            let same = self.parts.get(part_key(&mut buf, *key)).is_some_and(|p| {
                Arc::ptr_eq(&p.service, svc)
                    && p.slices.len() == slices.len()
                    && p.slices.iter().zip(slices).all(|(a, b)| Arc::ptr_eq(a, b))
            });
            if same {
                continue;
            }
            if let Some(old) = self.parts.remove(buf.as_str()) {
                self.retract(&old, &mut touched);
            }
            let (state, errors) = model::build_part(*key, svc, slices, config, zone);
            let part = Part { service: Arc::clone(svc), slices: slices.iter().map(|s| Arc::clone(s)).collect(), state, errors };
            self.assert(*key, &part, &mut touched);
            self.parts.insert(buf.clone(), part);
        }
        self.group_errors = grouped.errors;
        if everything { Update::Everything } else { Update::Touched(touched) }
    }

    /// Adds a Service's share. A frontend another Service holds goes to the
    /// first of the two by (namespace, name), as in `model::build`.
    fn assert(&mut self, key: ServiceKey, part: &Part, touched: &mut Touched) {
        let d = &mut self.desired;
        for (set, backends) in &part.state.backend_sets {
            d.backend_sets.insert(set.clone(), backends.clone());
            touched.sets.insert(set.clone());
            for b in backends {
                let t = (b.addr, b.port, b.proto);
                let counts = self.backend_claims.entry(t).or_default();
                counts.sets += 1;
                for bit in 0..8 {
                    if b.flags & (1 << bit) != 0 {
                        counts.bits[bit] += 1;
                    }
                }
                d.backends.insert(t, counts.union());
                touched.backends.insert(t);
            }
        }
        for (set, nets) in &part.state.source_ranges {
            d.source_ranges.insert(set.clone(), nets.clone());
            touched.sets.insert(set.clone());
        }
        for ip in &part.state.cluster_ips {
            *self.cluster_ip_claims.entry(*ip).or_default() += 1;
            d.cluster_ips.insert(*ip);
            touched.cluster_ips.insert(*ip);
        }
        for (fk, fe) in &part.state.frontends {
            *self.frontend_claims.entry(*fk).or_default() += 1;
            let ours = match d.frontends.get(fk) {
                None => true,
                Some(held) => (held.set.service.namespace.as_str(), held.set.service.name.as_str()) > key,
            };
            if ours {
                d.frontends.insert(*fk, fe.clone());
            }
            touched.frontends.insert(*fk);
        }
    }

    /// Takes a Service's share away; it must no longer be in `parts`.
    fn retract(&mut self, part: &Part, touched: &mut Touched) {
        let d = &mut self.desired;
        for (set, backends) in &part.state.backend_sets {
            d.backend_sets.remove(set);
            touched.sets.insert(set.clone());
            for b in backends {
                let t = (b.addr, b.port, b.proto);
                let counts = self.backend_claims.get_mut(&t).expect("claimed when asserted");
                counts.sets -= 1;
                for bit in 0..8 {
                    if b.flags & (1 << bit) != 0 {
                        counts.bits[bit] -= 1;
                    }
                }
                if counts.sets == 0 {
                    self.backend_claims.remove(&t);
                    d.backends.remove(&t);
                } else {
                    d.backends.insert(t, counts.union());
                }
                touched.backends.insert(t);
            }
        }
        for set in part.state.source_ranges.keys() {
            d.source_ranges.remove(set);
            touched.sets.insert(set.clone());
        }
        for ip in &part.state.cluster_ips {
            let n = self.cluster_ip_claims.get_mut(ip).expect("claimed when asserted");
            *n -= 1;
            if *n == 0 {
                self.cluster_ip_claims.remove(ip);
                d.cluster_ips.remove(ip);
            }
            touched.cluster_ips.insert(*ip);
        }
        for fk in part.state.frontends.keys() {
            touched.frontends.insert(*fk);
            let n = self.frontend_claims.get_mut(fk).expect("claimed when asserted");
            *n -= 1;
            if *n == 0 {
                self.frontend_claims.remove(fk);
                d.frontends.remove(fk);
                continue;
            }
            let held = &d.frontends[fk].set.service;
            let ours = part.state.frontends[fk].set.service.namespace == held.namespace
                && part.state.frontends[fk].set.service.name == held.name;
            if ours {
                // Contested (rare): the next claimant in (namespace, name) order takes it.
                let next = self.parts.values().find_map(|p| p.state.frontends.get(fk)).expect("another claim");
                d.frontends.insert(*fk, next.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        manifest,
        reconciler::{Contents, Reconciler},
    };

    /// Services svc0..svcN in two namespaces with overlapping ExternalIPs
    /// (contested frontends), shared endpoints, source ranges, local
    /// policies and slices without a Service: what a random step changes.
    fn service(i: usize, variant: usize) -> String {
        let ns = if i % 2 == 0 { "a" } else { "b" };
        let ext = ["", "externalIPs: [192.168.9.1]", "externalIPs: [192.168.9.1, 192.168.9.2]"][variant % 3];
        let policy = ["Cluster", "Local"][variant % 2];
        let ranges = if variant % 4 == 3 { "loadBalancerSourceRanges: [10.1.0.0/16]" } else { "" };
        let ty = if variant % 4 == 3 { "LoadBalancer" } else { "ClusterIP" };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: svc{i}, namespace: {ns}}}\nspec:\n  type: {ty}\n  \
             clusterIP: 10.96.0.{}\n  externalTrafficPolicy: {policy}\n  {ext}\n  {ranges}\n  ports: [{{name: p, port: {}, nodePort: {}}}]\n\
             status: {{loadBalancer: {{ingress: [{{ip: 1.1.1.{i}}}]}}}}\n",
            i % 5 + 1,
            80 + variant % 2,
            30000 + i
        )
    }

    fn slice(i: usize, variant: usize) -> String {
        let ns = if i % 2 == 0 { "a" } else { "b" };
        let eps: String = (0..variant % 4)
            .map(|e| {
                let ready = (variant + e) % 3 != 0;
                let node = if e % 2 == 0 { "node-a" } else { "node-b" };
                format!("- {{addresses: [10.244.0.{}], nodeName: {node}, conditions: {{ready: {ready}, serving: true, terminating: {}}}}}\n", (i + e) % 6 + 1, !ready)
            })
            .collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: svc{i}-s, namespace: {ns}, labels: {{kubernetes.io/service-name: svc{i}}}}}\n\
             addressType: IPv4\nports: [{{name: p, port: 8080}}]\nendpoints:\n{eps}"
        )
    }

    fn parse(yaml: &str) -> manifest::Object {
        manifest::parse(std::path::Path::new("t.yaml"), yaml).unwrap().remove(0)
    }

    /// Random changes (add, change, remove Services and slices, node
    /// addresses) applied one by one: after each, the incremental state
    /// equals a full build, everything that differs from the state before
    /// is in the touched keys, and maps written with only the touched keys
    /// hold exactly what a full sync writes (IDs included).
    #[test]
    fn random_changes_match_a_full_build() {
        let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        const N: usize = 12;
        let mut services: Vec<Option<Arc<Service>>> = vec![None; N];
        let mut slices: Vec<Option<Arc<EndpointSlice>>> = vec![None; N];
        let mut config = ModelConfig { node_name: "node-a".into(), node_addresses: vec!["192.168.0.2".parse().unwrap()], ..Default::default() };
        let mut model = Model::default();
        let mut before = DesiredState::default();
        let (mut touched_maps, mut full_maps) = (Contents::default(), Contents::default());
        let (mut by_touched, mut by_full) = (Reconciler::adopt(Contents::default()), Reconciler::adopt(Contents::default()));
        for step in 0..600 {
            let i = next(N);
            match next(7) {
                0 => services[i] = None,
                1 => slices[i] = None,
                2 | 3 => match parse(&service(i, next(8))) {
                    manifest::Object::Service(s) => services[i] = Some(s),
                    _ => unreachable!(),
                },
                4 | 5 => match parse(&slice(i, next(8))) {
                    manifest::Object::EndpointSlice(s) => slices[i] = Some(s),
                    _ => unreachable!(),
                },
                _ => config.detect_local = !config.detect_local,
            }
            let snap = Snapshot {
                services: services.iter().flatten().cloned().collect(),
                slices: slices.iter().flatten().cloned().collect(),
                node: None,
            };
            let update = model.update(&snap, &config);
            let (want, want_errors) = model::build(&snap, &config);
            assert_eq!(model.desired(), &want, "step {step}");
            assert_eq!(model.errors(), want_errors, "step {step}");
            by_full.sync(&want, &mut full_maps).unwrap();
            match &update {
                Update::Touched(t) => by_touched.sync_touched(model.desired(), t, &mut touched_maps).unwrap(),
                Update::Everything => by_touched.sync(model.desired(), &mut touched_maps).unwrap(),
            };
            assert_eq!(touched_maps, full_maps, "step {step}");
            if let Update::Touched(t) = update {
                for k in want.frontends.keys().chain(before.frontends.keys()) {
                    let changed = want.frontends.get(k) != before.frontends.get(k);
                    assert!(!changed || t.frontends.contains(k), "step {step}: frontend {k:?} changed, not touched");
                }
                for k in want.backend_sets.keys().chain(before.backend_sets.keys()) {
                    let changed = want.backend_sets.get(k) != before.backend_sets.get(k)
                        || want.source_ranges.get(k) != before.source_ranges.get(k);
                    assert!(!changed || t.sets.contains(k), "step {step}: set {k:?} changed, not touched");
                }
                for k in want.backends.keys().chain(before.backends.keys()) {
                    assert!(want.backends.get(k) == before.backends.get(k) || t.backends.contains(k), "step {step}: backend {k:?}");
                }
                for k in want.cluster_ips.symmetric_difference(&before.cluster_ips) {
                    assert!(t.cluster_ips.contains(k), "step {step}: cluster IP {k}");
                }
            }
            before = want;
        }
    }

    #[test]
    fn an_unchanged_snapshot_touches_nothing() {
        let svc = match parse(&service(1, 1)) {
            manifest::Object::Service(s) => s,
            _ => unreachable!(),
        };
        let snap = Snapshot { services: vec![svc], ..Default::default() };
        let config = ModelConfig::default();
        let mut model = Model::default();
        assert_eq!(model.update(&snap, &config), Update::Everything);
        assert_eq!(model.update(&snap.clone(), &config), Update::Touched(Touched::default()));
    }
}
