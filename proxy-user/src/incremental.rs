//! The desired state kept up to date as snapshots arrive: only the Services
//! whose objects changed (a Service, or one of its EndpointSlices, is a new
//! object: sources share unchanged objects between snapshots) are rebuilt,
//! and the update says which map keys it touched, so the reconciler looks
//! at those alone. The service CIDRs are a small part apart: recomputed
//! whole at every update, and compared whole by every sync; as endpoints
//! are checked against them, a change of them rebuilds everything.
//! `model::build` is the reference it must always equal.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use k8s_openapi::{
    api::core::v1::Service,
    jiff::Timestamp,
};
use proxy_common::{BACKEND_FLAG_BITS, FrontendKey};
use rayon::prelude::*;

use crate::{
    endpoint_slice::EndpointSlice,
    capacity::{self, Budget, Full, Unlimited},
    model::{
        self, BackendSetKey, BackendTuple, DesiredState, ModelConfig, ObjectError, ServiceKey, Share, SkipReason,
        trigger_times::TriggerTimes,
    },
    precedence::{self, Claim},
    service_cidrs,
    source::Snapshot,
    topology,
};

/// Services built per task of the CPUs' pool: fewer are built on the
/// caller's thread (an update usually rebuilds one or a few).
const PARTS_PER_TASK: usize = 64;

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
    /// Everything was rebuilt (first update, or the node, the config or the
    /// effective service CIDRs changed).
    Everything,
    Touched(Touched),
}

/// What one Service's objects gave.
struct Part {
    share: Share,
    errors: Vec<ObjectError>,
    /// The Service's creationTimestamp, for `precedence`.
    created: Option<Timestamp>,
}

impl Part {
    /// Its claim on a frontend it has.
    fn claim(&self, fk: &FrontendKey) -> Claim<'_> {
        let fe = self.share.frontend(fk).expect("a frontend of the part");
        Claim { kind: fe.kind, created: self.created, service: (&fe.set.service.namespace, &fe.set.service.name) }
    }
}

/// A Service that did not fit in the maps (`capacity`): its part, kept to
/// be tried again at the next update, and the map it would have overflowed.
struct Refused {
    part: Part,
    full: Full,
}

/// How many backend sets hold a backend, per flag bit: the union of its
/// flags is the bits still counted.
/// (One per backend: only the bits flags use are counted.)
#[derive(Default)]
struct FlagCounts {
    sets: u32,
    bits: [u32; BACKEND_FLAG_BITS],
}

impl FlagCounts {
    fn add(&mut self, flags: u8) {
        self.sets += 1;
        (0..BACKEND_FLAG_BITS).filter(|b| flags & (1 << b) != 0).for_each(|b| self.bits[b] += 1);
    }

    fn remove(&mut self, flags: u8) {
        self.sets -= 1;
        (0..BACKEND_FLAG_BITS).filter(|b| flags & (1 << b) != 0).for_each(|b| self.bits[b] -= 1);
    }

    fn union(&self) -> u8 {
        (0..BACKEND_FLAG_BITS).filter(|b| self.bits[*b] > 0).fold(0, |acc, b| acc | (1 << b))
    }
}

/// An object of the last snapshot, held so its address (its identity
/// here) cannot be reused by another object while it is remembered.
enum Held {
    Service(#[allow(dead_code)] Arc<Service>),
    Slice(#[allow(dead_code)] Arc<EndpointSlice>),
}

struct Seen {
    /// The Service (index into `keys`) the object belongs to.
    key: u32,
    generation: u64,
    _object: Held,
}

/// Slices without the service-name label share this key.
const UNLABELLED: u32 = 0;

#[derive(Default)]
pub struct Model {
    config: Option<(ModelConfig, String)>,
    /// Every object of the last snapshot, by address.
    seen: HashMap<usize, Seen>,
    generation: u64,
    /// Service keys as `namespace\0name` (sorts as (namespace, name) does),
    /// interned; index 0 is UNLABELLED.
    keys: Vec<String>,
    key_ids: HashMap<String, u32>,
    /// The Services in `desired` (admitted), by key.
    parts: BTreeMap<String, Part>,
    /// The Services refused for want of room in a map, by key: not in `desired`.
    refused: BTreeMap<String, Refused>,
    /// What in a key's objects as a whole was skipped (duplicate Services,
    /// slices without a Service or label).
    key_errors: BTreeMap<u32, Vec<ObjectError>>,
    /// What in the ServiceCIDRs was skipped.
    service_cidr_errors: Vec<ObjectError>,
    desired: DesiredState,
    /// How many Services claim each frontend and ClusterIP.
    frontend_claims: HashMap<FrontendKey, u32>,
    /// The Services (keys into `parts`) claiming each frontend more than one claims.
    contested: BTreeMap<FrontendKey, BTreeSet<String>>,
    cluster_ip_claims: HashMap<IpAddr, u32>,
    backend_claims: HashMap<BackendTuple, FlagCounts>,
    /// The Services (keys into `parts`) with a health check on each port.
    health_check_claims: BTreeMap<u16, BTreeSet<String>>,
    /// When the slices' changes happened, for the programming latency.
    trigger_times: TriggerTimes,
}

fn joined(key: ServiceKey) -> String {
    format!("{}\0{}", key.0, key.1)
}

impl Model {
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// When the changes to slices since the last call happened (their
    /// last-change-trigger-time): to be taken once they are in the maps.
    pub fn take_trigger_times(&mut self) -> Vec<chrono::DateTime<chrono::Utc>> {
        self.trigger_times.take()
    }

    /// What was skipped (the same as `model::build` reports, not in its
    /// order), and each Service refused for want of room in a map.
    pub fn errors(&self) -> Vec<ObjectError> {
        let parts = self.parts.values().chain(self.refused.values().map(|r| &r.part)).flat_map(|p| p.errors.iter());
        let mut errors: Vec<ObjectError> =
            self.key_errors.values().flatten().chain(parts).chain(&self.service_cidr_errors).cloned().collect();
        for (joined, r) in &self.refused {
            let (ns, name) = joined.split_once('\0').unwrap_or(("", ""));
            errors.push(ObjectError::service(ns, name, SkipReason::MapFull, r.full.to_string()));
        }
        let mut conflicts = Vec::new();
        for (fk, claimants) in &self.contested {
            let claims: Vec<Claim> = claimants.iter().map(|joined| self.parts[joined].claim(fk)).collect();
            precedence::report_losers(fk, &claims, &mut conflicts);
        }
        errors.extend(conflicts);
        errors
    }

    fn key_id(&mut self, key: ServiceKey) -> u32 {
        let joined = joined(key);
        if let Some(id) = self.key_ids.get(&joined) {
            return *id;
        }
        let id = self.keys.len() as u32;
        self.keys.push(joined.clone());
        self.key_ids.insert(joined, id);
        id
    }

    /// How many Services wait for room in a map.
    pub fn refused(&self) -> usize {
        self.refused.len()
    }

    /// `update_within` maps without limits.
    pub fn update(&mut self, snapshot: &Snapshot, config: &ModelConfig) -> Update {
        self.update_within(snapshot, config, &Unlimited)
    }

    /// Brings the state up to `snapshot`. Objects are told apart by address:
    /// one not seen before, or seen before and now gone, marks its Service
    /// as touched, and only touched Services are rebuilt. The cost is a hash
    /// lookup per object, plus the work of what changed.
    ///
    /// Rebuilt Services, and those refused before, are admitted in
    /// `namespace/name` order while the maps (`held`) have room for what
    /// each adds (`capacity`); one that does not fit is left out of the
    /// desired state whole, and tried again at the next update.
    pub fn update_within(&mut self, snapshot: &Snapshot, config: &ModelConfig, held: &(impl capacity::Held + ?Sized)) -> Update {
        let zone = topology::node_zone(snapshot.node.as_ref());
        let (cidrs, cidr_errors) = service_cidrs::effective(&snapshot.service_cidrs, &config.service_cidrs);
        // Every Service's endpoints are checked against the service CIDRs
        // (`endpoint_ips`): when those change (rarely), all are rebuilt.
        let everything =
            self.config.as_ref().is_none_or(|(c, z)| c != config || z != zone) || cidrs != self.desired.service_cidrs;
        if everything {
            // Trigger times outlive a rebuild: a slice's change is counted once.
            let trigger_times = std::mem::take(&mut self.trigger_times);
            *self = Model { config: Some((config.clone(), zone.to_string())), trigger_times, ..Default::default() };
            self.keys.push("\0unlabelled".into());
        }
        self.desired.service_cidrs = cidrs;
        self.service_cidr_errors = cidr_errors;
        self.generation += 1;
        let generation = self.generation;
        let mut keys: BTreeSet<u32> = BTreeSet::new();
        for svc in &snapshot.services {
            match self.seen.get_mut(&(Arc::as_ptr(svc) as usize)) {
                Some(seen) => seen.generation = generation,
                None => {
                    let key = self.key_id(model::service_key(svc));
                    keys.insert(key);
                    let seen = Seen { key, generation, _object: Held::Service(Arc::clone(svc)) };
                    self.seen.insert(Arc::as_ptr(svc) as usize, seen);
                }
            }
        }
        for slice in &snapshot.slices {
            match self.seen.get_mut(&(Arc::as_ptr(slice) as usize)) {
                Some(seen) => seen.generation = generation,
                None => {
                    self.trigger_times.changed(slice);
                    let key = model::slice_owner(slice).map_or(UNLABELLED, |k| self.key_id(k));
                    keys.insert(key);
                    let seen = Seen { key, generation, _object: Held::Slice(Arc::clone(slice)) };
                    self.seen.insert(Arc::as_ptr(slice) as usize, seen);
                }
            }
        }
        self.trigger_times.forget_gone(snapshot.slices.iter().map(|s| &**s));
        self.seen.retain(|_, seen| {
            let live = seen.generation == generation;
            if !live {
                keys.insert(seen.key);
            }
            live
        });

        let mut touched = Touched::default();
        if keys.is_empty() && self.refused.is_empty() {
            return if everything { Update::Everything } else { Update::Touched(touched) };
        }
        // The touched keys' objects, in snapshot order.
        let mut services: HashMap<u32, Vec<&Arc<Service>>> = HashMap::new();
        let mut slices: HashMap<u32, Vec<&Arc<EndpointSlice>>> = HashMap::new();
        for svc in &snapshot.services {
            let key = self.seen[&(Arc::as_ptr(svc) as usize)].key;
            if keys.contains(&key) {
                services.entry(key).or_default().push(svc);
            }
        }
        for slice in &snapshot.slices {
            let key = self.seen[&(Arc::as_ptr(slice) as usize)].key;
            if keys.contains(&key) {
                slices.entry(key).or_default().push(slice);
            }
        }
        // The rebuilt Services: each one's objects now, its part below.
        let mut rebuilt = Vec::new();
        for key in keys {
            let svcs = services.remove(&key).unwrap_or_default();
            let its_slices = slices.remove(&key).unwrap_or_default();
            let joined = self.keys[key as usize].clone();
            let service_key = joined.split_once('\0').unwrap_or(("", ""));
            let mut errors = Vec::new();
            if key == UNLABELLED {
                errors.extend(its_slices.iter().map(|s| model::unlabelled_slice(s)));
            } else if svcs.is_empty() {
                errors.extend(its_slices.iter().map(|s| model::orphan_slice(service_key, s)));
            } else {
                errors.extend((1..svcs.len()).map(|_| model::duplicate_service(service_key)));
            }
            if let Some(old) = self.parts.remove(&joined) {
                self.retract(&joined, &old, &mut touched);
            }
            self.refused.remove(&joined);
            if errors.is_empty() {
                self.key_errors.remove(&key);
            } else {
                self.key_errors.insert(key, errors);
            }
            if let Some(svc) = svcs.last() {
                rebuilt.push((joined, *svc, its_slices));
            }
        }
        // Each Service's part depends on its own objects only: built on
        // every CPU (the first sync builds all of them).
        let cidrs = &self.desired.service_cidrs;
        let build = |(joined, svc, slices): &(String, &Arc<Service>, Vec<&Arc<EndpointSlice>>)| {
            let service_key = joined.split_once('\0').unwrap_or(("", ""));
            let (state, errors) = model::build_part(service_key, svc, slices, config, zone, cidrs);
            Part { share: state.into(), errors, created: precedence::created(svc) }
        };
        let parts: Vec<Part> = if rebuilt.len() < PARTS_PER_TASK {
            rebuilt.iter().map(build).collect()
        } else {
            rebuilt.par_iter().with_min_len(PARTS_PER_TASK).map(build).collect()
        };
        // By key, so in namespace/name order.
        let mut candidates: BTreeMap<String, Part> =
            rebuilt.into_iter().map(|(joined, _, _)| joined).zip(parts).collect();
        // Those refused before, unchanged: there may be room now.
        for (joined, refused) in std::mem::take(&mut self.refused) {
            candidates.insert(joined, refused.part);
        }
        let everyone_fits = capacity::room_for_all(held, candidates.values().map(|p| &p.share));
        let mut budget = Budget::new(held);
        for (joined, part) in candidates {
            match if everyone_fits { Ok(()) } else { budget.admit(&part.share) } {
                Ok(()) => {
                    self.assert(&joined, &part, (!everything).then_some(&mut touched));
                    self.parts.insert(joined, part);
                }
                Err(full) => {
                    self.refused.insert(joined, Refused { part, full });
                }
            }
        }
        if everything { Update::Everything } else { Update::Touched(touched) }
    }

    /// Adds a Service's share (`own` is its key; it is not in `parts` yet).
    /// A frontend another Service holds goes to the one `precedence` puts
    /// first, as in `model::build`. `touched`: none when everything is
    /// rebuilt (the reconciler then looks at every key anyway).
    fn assert(&mut self, own: &str, part: &Part, mut touched: Option<&mut Touched>) {
        let d = &mut self.desired;
        for (set, backends) in &part.share.backend_sets {
            d.backend_sets.insert(set.clone(), backends.clone());
            if let Some(keys) = touched.as_deref_mut() {
                keys.sets.insert(set.clone());
            }
            for b in backends {
                let t = (b.addr, b.port, b.proto);
                let counts = self.backend_claims.entry(t).or_default();
                counts.add(b.flags);
                d.backends.insert(t, counts.union());
                if let Some(keys) = touched.as_deref_mut() {
                    keys.backends.insert(t);
                }
            }
        }
        for (set, nets) in &part.share.source_ranges {
            d.source_ranges.insert(set.clone(), nets.clone());
            if let Some(keys) = touched.as_deref_mut() {
                keys.sets.insert(set.clone());
            }
        }
        for set in &part.share.maglev {
            d.maglev.insert(set.clone());
            if let Some(keys) = touched.as_deref_mut() {
                keys.sets.insert(set.clone());
            }
        }
        for ip in &part.share.cluster_ips {
            *self.cluster_ip_claims.entry(*ip).or_default() += 1;
            d.cluster_ips.insert(*ip);
            if let Some(keys) = touched.as_deref_mut() {
                keys.cluster_ips.insert(*ip);
            }
        }
        for (fk, fe) in &part.share.frontends {
            *self.frontend_claims.entry(*fk).or_default() += 1;
            if let Some(keys) = touched.as_deref_mut() {
                keys.frontends.insert(*fk);
            }
            let Some(held) = d.frontends.get(fk) else {
                d.frontends.insert(*fk, fe.clone());
                continue;
            };
            // Contested (rare): the holder is the best claim so far.
            let holder_key = joined((&held.set.service.namespace, &held.set.service.name));
            let holder = self.parts[&holder_key].claim(fk);
            let ours = part.claim(fk) < holder;
            let claimants = self.contested.entry(*fk).or_insert_with(|| BTreeSet::from([holder_key]));
            claimants.insert(own.to_string());
            if ours {
                d.frontends.insert(*fk, fe.clone());
            }
        }
        for (port, check) in &part.share.health_checks {
            let claimants = self.health_check_claims.entry(*port).or_default();
            claimants.insert(own.to_string());
            // The first Service by namespace/name holds the port.
            if claimants.first().is_some_and(|first| first == own) {
                d.health_checks.insert(*port, check.clone());
            }
        }
    }

    /// Takes a Service's share away (`own` is its key); it must no longer be in `parts`.
    fn retract(&mut self, own: &str, part: &Part, touched: &mut Touched) {
        let d = &mut self.desired;
        for (set, backends) in &part.share.backend_sets {
            d.backend_sets.remove(set);
            touched.sets.insert(set.clone());
            for b in backends {
                let t = (b.addr, b.port, b.proto);
                let counts = self.backend_claims.get_mut(&t).expect("claimed when asserted");
                counts.remove(b.flags);
                if counts.sets == 0 {
                    self.backend_claims.remove(&t);
                    d.backends.remove(&t);
                } else {
                    d.backends.insert(t, counts.union());
                }
                touched.backends.insert(t);
            }
        }
        for (set, _) in &part.share.source_ranges {
            d.source_ranges.remove(set);
            touched.sets.insert(set.clone());
        }
        for set in &part.share.maglev {
            d.maglev.remove(set);
            touched.sets.insert(set.clone());
        }
        for ip in &part.share.cluster_ips {
            let n = self.cluster_ip_claims.get_mut(ip).expect("claimed when asserted");
            *n -= 1;
            if *n == 0 {
                self.cluster_ip_claims.remove(ip);
                d.cluster_ips.remove(ip);
            }
            touched.cluster_ips.insert(*ip);
        }
        for (fk, fe) in &part.share.frontends {
            touched.frontends.insert(*fk);
            let n = self.frontend_claims.get_mut(fk).expect("claimed when asserted");
            *n -= 1;
            if *n == 0 {
                self.frontend_claims.remove(fk);
                d.frontends.remove(fk);
                continue;
            }
            // Contested (rare): if this Service held it, the best other claim takes it.
            let claimants = self.contested.get_mut(fk).expect("claimed by more than one");
            claimants.remove(own);
            let held = &d.frontends[fk].set.service;
            let ours = fe.set.service.namespace == held.namespace && fe.set.service.name == held.name;
            if ours {
                let next = claimants.iter().map(|c| &self.parts[c]).min_by(|a, b| a.claim(fk).cmp(&b.claim(fk))).expect("another claim");
                d.frontends.insert(*fk, next.share.frontend(fk).expect("its claim").clone());
            }
            if claimants.len() < 2 {
                self.contested.remove(fk);
            }
        }
        for (port, _) in &part.share.health_checks {
            let claimants = self.health_check_claims.get_mut(port).expect("claimed when asserted");
            claimants.remove(own);
            match claimants.first() {
                Some(next) => {
                    d.health_checks.insert(*port, self.parts[next].share.health_check(*port).expect("its claim").clone());
                }
                None => {
                    self.health_check_claims.remove(port);
                    d.health_checks.remove(port);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::networking::v1::ServiceCIDR;

    use crate::{
        capacity::ServiceMap,
        manifest,
        maps::{Contents, MapWriter},
        reconciler::Reconciler,
        source::manifests,
    };

    /// How many variants `service` and `slice` have.
    const SERVICE_VARIANTS: usize = 1440;
    const SLICE_VARIANTS: usize = 96;

    /// Services svc0..svcN in two namespaces with contested frontends (shared
    /// ClusterIPs, ExternalIPs and LB IPs; an ExternalIP on another's
    /// ClusterIP or NodePort; older and newer and unstamped Services), shared
    /// endpoints, source ranges, local policies, Proxy-mode LB IPs and
    /// another proxy's Services: what a random step changes.
    fn service(i: usize, variant: usize) -> String {
        let ns = if i % 2 == 0 { "a" } else { "b" };
        let ext = [
            "",
            "externalIPs: [192.168.9.1]",
            "externalIPs: [192.168.9.1, 192.168.9.2]",
            "externalIPs: [10.96.0.1, 192.168.9.2]",
            "externalIPs: [192.168.0.2]",
        ][variant % 5];
        let policy = ["Cluster", "Local"][variant / 5 % 2];
        // Two Services may claim one health check port (the API forbids it; the first holds it).
        let health_check = if policy == "Local" { format!("healthCheckNodePort: {}", 32000 + i % 3) } else { String::new() };
        let lb = variant / 10 % 2 == 1;
        let ranges = if lb { "loadBalancerSourceRanges: [10.1.0.0/16]" } else { "" };
        let ty = if lb { "LoadBalancer" } else { "ClusterIP" };
        // 30001 is svc1's NodePort: an ExternalIP on the node address takes it.
        let port = [80, 81, 30001][variant / 20 % 3];
        let created = ["", "creationTimestamp: '2025-01-01T00:00:00Z', ", "creationTimestamp: '2025-01-02T00:00:00Z', "][variant / 60 % 3];
        let ip_mode = if variant / 180 % 2 == 1 { ", ipMode: Proxy" } else { "" };
        let labels = if variant / 360 % 4 == 3 { "labels: {service.kubernetes.io/service-proxy-name: other}, " } else { "" };
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: svc{i}, namespace: {ns}, {created}{labels}}}\nspec:\n  type: {ty}\n  \
             clusterIP: 10.96.0.{}\n  externalTrafficPolicy: {policy}\n  {health_check}\n  {ext}\n  {ranges}\n  ports: [{{name: p, port: {port}, nodePort: {}}}]\n\
             status: {{loadBalancer: {{ingress: [{{ip: 1.1.1.{}{ip_mode}}}]}}}}\n",
            i % 5 + 1,
            30000 + i,
            i % 4,
        )
    }

    /// Slice `i` with up to three endpoints; in a third of the variants its
    /// first endpoint is an address that can never be one, in another third
    /// one inside a service CIDR some ServiceCIDR variant or the flag has
    /// (refused while that CIDR is in effect, served otherwise).
    fn slice(i: usize, variant: usize) -> String {
        let ns = if i % 2 == 0 { "a" } else { "b" };
        let eps: String = (0..variant % 4)
            .map(|e| {
                let ready = (variant + e) % 3 != 0;
                let node = if e % 2 == 0 { "node-a" } else { "node-b" };
                let addr = match (e, variant / 32) {
                    (0, 1) => ["127.0.0.1", "169.254.169.254", "224.0.0.1", "0.0.0.0", "255.255.255.255"][i % 5].to_string(),
                    (0, 2) => ["10.96.0.7", "10.97.0.7", "172.30.0.7"][i % 3].to_string(),
                    _ => format!("10.244.0.{}", (i + e) % 6 + 1),
                };
                format!("- {{addresses: [{addr}], nodeName: {node}, conditions: {{ready: {ready}, serving: true, terminating: {}}}}}\n", !ready)
            })
            .collect();
        let headless = if variant % 32 / 8 == 0 { ", service.kubernetes.io/headless: ''" } else { "" };
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: svc{i}-s, namespace: {ns}, labels: {{kubernetes.io/service-name: svc{i}{headless}}}}}\n\
             addressType: IPv4\nports: [{{name: p, port: 8080}}]\nendpoints:\n{eps}"
        )
    }

    /// One object as the manifests source serves it: none when its labels
    /// make it another proxy's.
    fn served(yaml: &str) -> Option<manifest::Object> {
        manifests::ours(manifest::parse(std::path::Path::new("t.yaml"), yaml).unwrap()).pop()
    }

    fn served_service(yaml: &str) -> Option<Arc<Service>> {
        served(yaml).map(|o| match o {
            manifest::Object::Service(s) => s,
            _ => unreachable!(),
        })
    }

    fn served_slice(yaml: &str) -> Option<Arc<EndpointSlice>> {
        served(yaml).map(|o| match o {
            manifest::Object::EndpointSlice(s) => s,
            _ => unreachable!(),
        })
    }

    /// ServiceCIDR `i` in one of four variants: none, one CIDR, one with a
    /// bad entry, two families.
    fn service_cidr(i: usize, variant: usize) -> Option<Arc<ServiceCIDR>> {
        let cidrs = ["", "[10.96.0.0/16]", "[10.96.0.0/16, bogus]", "['fd00:10:96::/112', 10.97.0.0/16]"][variant];
        let yaml = format!("apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {{name: cidr{i}}}\nspec: {{cidrs: {cidrs}}}\n");
        (!cidrs.is_empty()).then(|| match served(&yaml) {
            Some(manifest::Object::ServiceCIDR(c)) => c,
            other => unreachable!("{other:?}"),
        })
    }

    /// A small deterministic generator: `next(n)` is in 0..n.
    fn xorshift(mut rng: u64) -> impl FnMut(usize) -> usize {
        move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        }
    }

    /// Random changes (add, change, remove Services and slices, node
    /// addresses, ServiceCIDRs) applied one by one: after each, the
    /// incremental state equals a full build, everything that differs from
    /// the state before is in the touched keys, and maps written with only
    /// the touched keys hold exactly what a full sync writes (IDs included).
    #[test]
    fn random_changes_match_a_full_build() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        const N: usize = 12;
        // Slot N + i: a second definition of Service i, or a slice of i without its label.
        let mut services: Vec<Option<Arc<Service>>> = vec![None; 2 * N];
        let mut slices: Vec<Option<Arc<EndpointSlice>>> = vec![None; 2 * N];
        let mut cidrs: [Option<Arc<ServiceCIDR>>; 2] = [None, None];
        let mut config = ModelConfig {
            node_name: "node-a".into(),
            node_addresses: vec!["192.168.0.2".parse().unwrap()],
            service_cidrs: vec!["172.30.0.0/16".parse().unwrap()],
            ..Default::default()
        };
        let mut model = Model::default();
        let mut before = DesiredState::default();
        let (mut touched_maps, mut full_maps) = (Contents::default(), Contents::default());
        let (mut by_touched, mut by_full) = (Reconciler::adopt(Contents::default()), Reconciler::adopt(Contents::default()));
        // Which contests the steps went through: (losing kind, winning kind).
        let mut contests: BTreeSet<(String, String)> = BTreeSet::new();
        let mut service_cidrs_seen: BTreeSet<BTreeSet<ipnet::IpNet>> = BTreeSet::new();
        // Endpoint addresses the steps refused (true) and served (false).
        let mut endpoint_checks: BTreeSet<(String, bool)> = BTreeSet::new();
        for step in 0..1500 {
            let i = next(N);
            match next(9) {
                0 => services[i + N * next(2)] = None,
                1 => slices[i + N * next(2)] = None,
                7 => services[i + N] = served_service(&service(i, next(SERVICE_VARIANTS))),
                8 => {
                    let unlabelled = slice(i, next(SLICE_VARIANTS)).replace("labels: {kubernetes.io/service-name: svc", "labels: {x: svc");
                    slices[i + N] = served_slice(&unlabelled);
                }
                2 | 3 => services[i] = served_service(&service(i, next(SERVICE_VARIANTS))),
                4 | 5 => slices[i] = served_slice(&slice(i, next(SLICE_VARIANTS))),
                _ => config.detect_local = !config.detect_local,
            }
            // Now and then a ServiceCIDR comes, changes or goes (outside
            // `next`, so the steps above stay what they were).
            if step % 37 == 0 {
                cidrs[step / 37 % 2] = service_cidr(step / 37 % 2, step / 74 % 4);
            }
            let snap = Snapshot {
                services: services.iter().flatten().cloned().collect(),
                slices: slices.iter().flatten().cloned().collect(),
                node: None,
                service_cidrs: cidrs.iter().flatten().cloned().collect(),
            };
            let update = model.update(&snap, &config);
            let (want, want_errors) = model::build(&snap, &config);
            assert_eq!(model.desired(), &want, "step {step}");
            let sorted = |mut v: Vec<ObjectError>| {
                v.sort_by(|a, b| (&a.object, &a.reason).cmp(&(&b.object, &b.reason)));
                v
            };
            for e in want_errors.iter().filter(|e| e.reason.contains("frontend conflict")) {
                if let Some((loser, rest)) = e.reason.split_once(' ') {
                    let winner = rest.split("'s ").nth(1).and_then(|w| w.split(',').next());
                    contests.extend(winner.map(|w| (loser.to_string(), w.to_string())));
                }
            }
            for e in want_errors.iter().filter(|e| e.reason.contains(" refused: ")) {
                endpoint_checks.extend(e.reason.split_whitespace().nth(2).map(|addr| (addr.to_string(), true)));
            }
            endpoint_checks.extend(want.backends.keys().map(|(addr, ..)| (addr.to_string(), false)));
            assert_eq!(sorted(model.errors()), sorted(want_errors), "step {step}");
            by_full.sync(&want, &mut full_maps).unwrap();
            match &update {
                Update::Touched(t) => by_touched.sync_touched(model.desired(), t, &mut touched_maps).unwrap(),
                Update::Everything => by_touched.sync(model.desired(), &mut touched_maps).unwrap(),
            };
            assert_eq!(touched_maps, full_maps, "step {step}");
            service_cidrs_seen.insert(touched_maps.service_cidrs.clone());
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
        assert!(service_cidrs_seen.len() >= 4, "ServiceCIDR variants seen: {service_cidrs_seen:?}");
        for addr in ["127.0.0.1", "169.254.169.254", "224.0.0.1", "0.0.0.0", "255.255.255.255"] {
            assert!(endpoint_checks.contains(&(addr.to_string(), true)), "{addr} never refused: {endpoint_checks:?}");
            assert!(!endpoint_checks.contains(&(addr.to_string(), false)), "{addr} served");
        }
        // Addresses in a service CIDR: refused while it is in effect, served once it is not.
        for addr in ["10.96.0.7", "10.97.0.7", "172.30.0.7"] {
            for refused in [true, false] {
                assert!(endpoint_checks.contains(&(addr.to_string(), refused)), "{addr} never refused={refused}: {endpoint_checks:?}");
            }
        }
        for (loser, winner) in [("ClusterIP", "ClusterIP"), ("ExternalIP", "ClusterIP"), ("NodePort", "ExternalIP"), ("ExternalIP", "ExternalIP"), ("LoadBalancer", "LoadBalancer")] {
            assert!(contests.contains(&(loser.to_string(), winner.to_string())), "no {loser} lost to a {winner}: {contests:?}");
        }
    }

    /// A ServiceCIDR that arrives later covers an endpoint served so far:
    /// every Service is rebuilt and that endpoint refused, as a full build
    /// refuses it; when the object goes, it is served again.
    #[test]
    fn a_service_cidr_that_comes_later_refuses_endpoints_inside_it() {
        let svc = served_service(&service(0, 0)).unwrap();
        let slice = served_slice(&slice(0, 11).replace("10.244.0.1]", "10.97.0.7]")).unwrap();
        let config = ModelConfig { node_name: "node-a".into(), service_cidrs: vec!["172.30.0.0/16".parse().unwrap()], ..Default::default() };
        let mut model = Model::default();
        let mut snap = Snapshot { services: vec![svc], slices: vec![slice], ..Default::default() };
        let endpoints = |m: &Model| m.desired().backends.keys().map(|(a, ..)| a.to_string()).collect::<Vec<_>>();
        let step = |model: &mut Model, snap: &Snapshot| {
            let update = model.update(snap, &config);
            let (want, errors) = model::build(snap, &config);
            assert_eq!(model.desired(), &want);
            assert_eq!(model.errors(), errors);
            update
        };
        assert_eq!(step(&mut model, &snap), Update::Everything);
        assert_eq!(endpoints(&model), ["10.97.0.7", "10.244.0.3"]);
        snap.service_cidrs = vec![service_cidr(0, 3).unwrap()];
        assert_eq!(step(&mut model, &snap), Update::Everything);
        assert_eq!(endpoints(&model), ["10.244.0.3"]);
        let text: Vec<String> = model.errors().iter().map(ToString::to_string).collect();
        assert_eq!(text, ["endpointslice a/svc0-s: endpoint address 10.97.0.7 refused: in service CIDR 10.97.0.0/16, which holds only ClusterIPs; skipped"]);
        // Unchanged CIDRs from a new object: nothing rebuilt.
        snap.service_cidrs = vec![service_cidr(0, 3).unwrap()];
        assert_eq!(step(&mut model, &snap), Update::Touched(Touched::default()));
        snap.service_cidrs.clear();
        assert_eq!(step(&mut model, &snap), Update::Everything);
        assert_eq!(endpoints(&model), ["10.97.0.7", "10.244.0.3"]);
    }

    #[test]
    fn an_unchanged_snapshot_touches_nothing() {
        let svc = served_service(&service(1, 1)).unwrap();
        let snap = Snapshot { services: vec![svc], ..Default::default() };
        let config = ModelConfig::default();
        let mut model = Model::default();
        assert_eq!(model.update(&snap, &config), Update::Everything);
        assert_eq!(model.update(&snap.clone(), &config), Update::Touched(Touched::default()));
    }

    /// The manifests source re-reads a file whose labels changed: a Service
    /// (and its slice) labelled for another proxy goes, and comes back when
    /// the label does, through the incremental model as through a full build.
    #[test]
    fn a_label_added_later_takes_a_service_away_and_removing_it_brings_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("web.yaml");
        // The Service and its slice, both with `label` (the controller copies a Service's labels to its slices).
        let web = |label: &str| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: a, labels: {{{label}}}}}\n\
                 spec: {{clusterIP: 10.96.0.10, externalIPs: [192.0.2.10], ports: [{{name: p, port: 80}}]}}\n---\n\
                 apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: web-1, namespace: a, labels: {{kubernetes.io/service-name: web, {label}}}}}\n\
                 addressType: IPv4\nports: [{{name: p, port: 8080}}]\nendpoints: [{{addresses: [10.244.0.1]}}]\n"
            )
        };
        let config = ModelConfig { node_name: "node-a".into(), ..Default::default() };
        let mut files = manifests::DirState::default();
        let mut model = Model::default();
        let mut apply = |yaml: &str| {
            std::fs::write(&file, yaml).unwrap();
            assert!(files.reload(vec![file.clone()]));
            let snap = files.snapshot();
            let update = model.update(&snap, &config);
            let (want, errors) = model::build(&snap, &config);
            assert_eq!(model.desired(), &want);
            assert!(errors.is_empty() && model.errors().is_empty(), "{errors:?}");
            (want.frontends.keys().copied().collect::<BTreeSet<_>>(), want.backends.len(), update)
        };
        let (served, backends, _) = apply(&web("app: web"));
        assert_eq!((served.len(), backends), (4, 1), "ClusterIP and ExternalIP, each in both scopes; one endpoint");
        let (gone, backends, update) = apply(&web("service.kubernetes.io/service-proxy-name: other"));
        assert_eq!((gone.len(), backends), (0, 0));
        let Update::Touched(touched) = update else { panic!("not incremental: {update:?}") };
        assert_eq!(touched.frontends, served);
        let (back, backends, update) = apply(&web("tier: front"));
        assert_eq!((&back, backends), (&served, 1));
        assert!(matches!(update, Update::Touched(t) if t.frontends == served));
    }

    /// The reconciler's maps with smaller capacities.
    struct Limited<'r> {
        maps: &'r Reconciler,
        capacity: Vec<(ServiceMap, u64)>,
    }

    impl capacity::Held for Limited<'_> {
        fn capacity(&self, map: ServiceMap) -> u64 {
            self.capacity.iter().find(|(m, _)| *m == map).map_or(map.default_capacity(), |(_, c)| *c)
        }
        fn entries(&self) -> capacity::Entries {
            self.maps.entries()
        }
        fn has_frontend(&self, key: &FrontendKey) -> bool {
            self.maps.has_frontend(key)
        }
        fn has_backend(&self, backend: &BackendTuple) -> bool {
            self.maps.has_backend(backend)
        }
        fn set_id(&self, set: &BackendSetKey) -> Option<u32> {
            self.maps.set_id(set)
        }
        fn slots(&self, service_id: u32) -> u32 {
            self.maps.slots(service_id)
        }
        fn has_source_range(&self, service_id: u32, net: &ipnet::IpNet) -> bool {
            self.maps.has_source_range(service_id, net)
        }
        fn has_maglev_table(&self, service_id: u32) -> bool {
            self.maps.has_maglev_table(service_id)
        }
    }

    /// Maps that remember the most entries each held at any moment.
    #[derive(Default)]
    struct Peak {
        maps: Contents,
        peak: capacity::Entries,
    }

    impl Peak {
        fn note(&mut self) -> anyhow::Result<()> {
            let c = &self.maps;
            let now = [c.frontends.len(), c.names.len(), c.slots.len(), c.backends.len(), c.source_ranges.len(), c.maglev.len()];
            for (peak, n) in self.peak.iter_mut().zip(now) {
                *peak = (*peak).max(n as u64);
            }
            Ok(())
        }
    }

    impl MapWriter for Peak {
        fn put_backend(&mut self, id: u32, b: &proxy_common::Backend) -> anyhow::Result<()> {
            self.maps.put_backend(id, b)?;
            self.note()
        }
        fn del_backend(&mut self, id: u32) -> anyhow::Result<()> {
            self.maps.del_backend(id)
        }
        fn put_slot(&mut self, k: &proxy_common::SlotKey, v: u32) -> anyhow::Result<()> {
            self.maps.put_slot(k, v)?;
            self.note()
        }
        fn del_slot(&mut self, k: &proxy_common::SlotKey) -> anyhow::Result<()> {
            self.maps.del_slot(k)
        }
        fn put_frontend(&mut self, k: &FrontendKey, e: &proxy_common::ServiceEntry) -> anyhow::Result<()> {
            self.maps.put_frontend(k, e)?;
            self.note()
        }
        fn del_frontend(&mut self, k: &FrontendKey) -> anyhow::Result<()> {
            self.maps.del_frontend(k)
        }
        fn put_name(&mut self, id: u32, n: &proxy_common::ServiceName) -> anyhow::Result<()> {
            self.maps.put_name(id, n)?;
            self.note()
        }
        fn del_name(&mut self, id: u32) -> anyhow::Result<()> {
            self.maps.del_name(id)
        }
        fn put_maglev(&mut self, id: u32, t: &proxy_common::MaglevTable) -> anyhow::Result<()> {
            self.maps.put_maglev(id, t)?;
            self.note()
        }
        fn del_maglev(&mut self, id: u32) -> anyhow::Result<()> {
            self.maps.del_maglev(id)
        }
        fn put_source_range(&mut self, id: u32, n: &ipnet::IpNet) -> anyhow::Result<()> {
            self.maps.put_source_range(id, n)?;
            self.note()
        }
        fn del_source_range(&mut self, id: u32, n: &ipnet::IpNet) -> anyhow::Result<()> {
            self.maps.del_source_range(id, n)
        }
        fn put_service_cidr(&mut self, n: &ipnet::IpNet) -> anyhow::Result<()> {
            self.maps.put_service_cidr(n)
        }
        fn del_service_cidr(&mut self, n: &ipnet::IpNet) -> anyhow::Result<()> {
            self.maps.del_service_cidr(n)
        }
        fn purge_affinity(
            &mut self,
            settle: bool,
            stale: &mut dyn FnMut(&proxy_common::AffinityKey, &proxy_common::AffinityEntry) -> bool,
        ) -> anyhow::Result<usize> {
            self.maps.purge_affinity(settle, stale)
        }
    }

    /// A LoadBalancer Service `a/NAME` on ClusterIP 10.96.1.IP and LB IP
    /// 192.0.2.IP with `ports` ports, each with the same `ranges`
    /// loadBalancerSourceRanges: ports x ranges SOURCE_RANGES entries.
    fn lb_service(name: &str, ip: u8, ports: usize, ranges: usize) -> Arc<Service> {
        let ports: Vec<String> = (0..ports).map(|p| format!("{{name: p{p}, port: {}}}", 1000 + p)).collect();
        let ranges: Vec<String> = (0..ranges).map(|r| format!("10.{}.{}.0/24", r / 256, r % 256)).collect();
        served_service(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: a}}\nspec:\n  type: LoadBalancer\n  \
             clusterIP: 10.96.1.{ip}\n  loadBalancerSourceRanges: [{}]\n  ports: [{}]\n\
             status: {{loadBalancer: {{ingress: [{{ip: 192.0.2.{ip}}}]}}}}\n",
            ranges.join(", "),
            ports.join(", ")
        ))
        .unwrap()
    }

    /// The agent's loop with SOURCE_RANGES holding `capacity` entries: update
    /// and sync, and again at once while the sync freed room someone waits
    /// for. Checks no map ever held more than its capacity and the touched
    /// sync wrote what a full one would.
    struct Agent {
        model: Model,
        reconciler: Reconciler,
        maps: Peak,
        capacity: u64,
        config: ModelConfig,
    }

    impl Agent {
        fn new(capacity: u64) -> Agent {
            Agent {
                model: Model::default(),
                reconciler: Reconciler::adopt(Contents::default()),
                maps: Peak::default(),
                capacity,
                config: ModelConfig { node_name: "node-a".into(), ..Default::default() },
            }
        }

        /// The passes it took.
        fn sync(&mut self, snap: &Snapshot) -> usize {
            for pass in 1..10 {
                let limited = Limited { maps: &self.reconciler, capacity: vec![(ServiceMap::SourceRanges, self.capacity)] };
                let update = self.model.update_within(snap, &self.config, &limited);
                let stats = match update {
                    Update::Touched(t) => self.reconciler.sync_touched(self.model.desired(), &t, &mut self.maps).unwrap(),
                    Update::Everything => self.reconciler.sync(self.model.desired(), &mut self.maps).unwrap(),
                };
                let ranges = self.maps.peak[ServiceMap::SourceRanges as usize];
                assert!(ranges <= self.capacity, "SOURCE_RANGES held {ranges} of {}", self.capacity);
                let mut full = Contents::default();
                Reconciler::adopt(Contents::default()).sync(self.model.desired(), &mut full).unwrap();
                assert_eq!(full.source_ranges.len(), self.maps.maps.source_ranges.len());
                assert_eq!(full.frontends.len(), self.maps.maps.frontends.len());
                if self.model.refused() == 0 || stats.deletes == 0 {
                    return pass;
                }
            }
            panic!("no end to the passes");
        }

        /// The Services with frontends in the maps.
        fn served(&self) -> BTreeSet<String> {
            let names = &self.maps.maps.names;
            let ids: BTreeSet<u32> = self.maps.maps.frontends.values().filter(|e| e.service_id != 0).map(|e| e.service_id).collect();
            ids.iter().map(|id| names[id].0.split(':').next().unwrap().to_string()).collect()
        }

        fn map_full(&self) -> Vec<String> {
            let errors = self.model.errors();
            let full = errors.iter().filter(|e| crate::metrics::classify(e) == ("Service", "map_full"));
            full.map(ToString::to_string).collect()
        }
    }

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_service_too_big_for_a_map_is_left_out_whole_and_the_rest_served() {
        let mut agent = Agent::new(100);
        let small = served_service(&service(0, 0)).unwrap();
        // 5 ports x 30 ranges = 150 entries: more than SOURCE_RANGES holds.
        let big = lb_service("big", 1, 5, 30);
        let snap = Snapshot { services: vec![big.clone(), small.clone()], ..Default::default() };
        agent.sync(&snap);
        assert_eq!(agent.served(), names(&["a/svc0"]));
        assert!(agent.maps.maps.source_ranges.is_empty(), "nothing of the big Service written");
        assert_eq!(
            agent.map_full(),
            ["service a/big: needs 150 entries in map SOURCE_RANGES, which has no room for them (capacity 100 entries; \
              map full); not programmed, tried again at every sync"]
        );
        // A Service added later, after it in name order, is served.
        let later = lb_service("later", 2, 1, 10);
        let snap = Snapshot { services: vec![big.clone(), small.clone(), later.clone()], ..Default::default() };
        agent.sync(&snap);
        assert_eq!(agent.served(), names(&["a/svc0", "a/later"]));
        assert_eq!(agent.map_full().len(), 1, "reported the same way, once");
        // Room appears when it shrinks: 5 x 18 = 90, with later's 10.
        let shrunk = lb_service("big", 1, 5, 18);
        let snap = Snapshot { services: vec![shrunk, small, later], ..Default::default() };
        assert_eq!(agent.sync(&snap), 1);
        assert_eq!(agent.served(), names(&["a/svc0", "a/later", "a/big"]));
        assert_eq!(agent.maps.maps.source_ranges.len(), 100);
        assert!(agent.map_full().is_empty());
    }

    #[test]
    fn room_a_removal_frees_goes_to_the_waiting_service_in_the_next_pass() {
        let mut agent = Agent::new(100);
        let (one, two) = (lb_service("one", 1, 2, 30), lb_service("two", 2, 2, 30));
        // 60 + 60 > 100: the first by name is served, whatever the snapshot's order.
        agent.sync(&Snapshot { services: vec![two.clone(), one.clone()], ..Default::default() });
        assert_eq!(agent.served(), names(&["a/one"]));
        assert_eq!(agent.map_full().len(), 1);
        // `one` goes: its entries leave the maps at the end of that sync,
        // and `two` is admitted by the pass right after.
        assert_eq!(agent.sync(&Snapshot { services: vec![two.clone()], ..Default::default() }), 2);
        assert_eq!(agent.served(), names(&["a/two"]));
        assert!(agent.map_full().is_empty());
        // A newcomer that sorts first does not push out what is served.
        agent.sync(&Snapshot { services: vec![two, one], ..Default::default() });
        assert_eq!(agent.served(), names(&["a/two"]));
        assert_eq!(agent.map_full()[0].split(':').next(), Some("service a/one"));
    }

    #[test]
    fn a_served_service_that_outgrows_a_map_is_taken_out_whole_and_back_when_it_fits() {
        let mut agent = Agent::new(100);
        let small = served_service(&service(0, 10)).unwrap();
        agent.sync(&Snapshot { services: vec![lb_service("big", 1, 2, 40), small.clone()], ..Default::default() });
        assert_eq!(agent.served(), names(&["a/big", "a/svc0"]));
        // svc0 (variant 10) has one source range: 80 + 1 held; 3 x 40 does not fit.
        agent.sync(&Snapshot { services: vec![lb_service("big", 1, 3, 40), small.clone()], ..Default::default() });
        assert_eq!(agent.served(), names(&["a/svc0"]), "no half-programmed Service");
        assert_eq!(agent.maps.maps.source_ranges.len(), 1);
        agent.sync(&Snapshot { services: vec![lb_service("big", 1, 3, 33), small], ..Default::default() });
        assert_eq!(agent.served(), names(&["a/big", "a/svc0"]));
        assert_eq!(agent.maps.maps.source_ranges.len(), 100);
    }

    /// Random changes as in `random_changes_match_a_full_build`, with maps
    /// so small that Services are refused and admitted again all the time:
    /// no map ever holds more than its capacity, maps written with only the
    /// touched keys hold what a full sync of the same desired state writes,
    /// and each Service is either served as a full build has it or refused.
    #[test]
    fn random_changes_in_small_maps_never_overflow_them() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        const N: usize = 12;
        let capacity = vec![(ServiceMap::Frontends, 40), (ServiceMap::Backends, 4), (ServiceMap::SourceRanges, 3), (ServiceMap::Slots, 12)];
        let mut services: Vec<Option<Arc<Service>>> = vec![None; N];
        let mut slices: Vec<Option<Arc<EndpointSlice>>> = vec![None; N];
        let mut config = ModelConfig { node_name: "node-a".into(), node_addresses: vec!["192.168.0.2".parse().unwrap()], ..Default::default() };
        let mut model = Model::default();
        let (mut touched_maps, mut full_maps) = (Peak::default(), Contents::default());
        let (mut by_touched, mut by_full) = (Reconciler::adopt(Contents::default()), Reconciler::adopt(Contents::default()));
        let (mut refusals, mut admitted_later) = (0, 0);
        for step in 0..1500 {
            let i = next(N);
            match next(7) {
                0 => services[i] = None,
                1 => slices[i] = None,
                2 | 3 => services[i] = served_service(&service(i, next(SERVICE_VARIANTS))),
                4 | 5 => slices[i] = served_slice(&slice(i, next(SLICE_VARIANTS))),
                _ => config.detect_local = !config.detect_local,
            }
            let snap = Snapshot {
                services: services.iter().flatten().cloned().collect(),
                slices: slices.iter().flatten().cloned().collect(),
                ..Default::default()
            };
            let refused_before = model.refused();
            for pass in 0.. {
                assert!(pass < 10, "step {step}: no end to the passes");
                let limited = Limited { maps: &by_touched, capacity: capacity.clone() };
                let update = model.update_within(&snap, &config, &limited);
                let stats = match &update {
                    Update::Touched(t) => by_touched.sync_touched(model.desired(), t, &mut touched_maps).unwrap(),
                    Update::Everything => by_touched.sync(model.desired(), &mut touched_maps).unwrap(),
                };
                by_full.sync(model.desired(), &mut full_maps).unwrap();
                assert_eq!(touched_maps.maps, full_maps, "step {step} pass {pass}");
                for (map, cap) in &capacity {
                    let peak = touched_maps.peak[*map as usize];
                    assert!(peak <= *cap, "step {step}: {} held {peak} of {cap}", map.name());
                }
                if model.refused() == 0 || stats.deletes == 0 {
                    break;
                }
            }
            // Settled: a Service waiting for room has none, even after the last pass's removals.
            let waiting = model.refused();
            let limited = Limited { maps: &by_touched, capacity: capacity.clone() };
            assert_eq!(model.update_within(&snap, &config, &limited), Update::Touched(Touched::default()), "step {step}");
            assert_eq!(model.refused(), waiting);
            refusals += model.refused();
            admitted_later += usize::from(model.refused() < refused_before);
            // Served as a full build has it, or refused (and reported).
            let (want, _) = model::build(&snap, &config);
            let refused: BTreeSet<String> = model
                .errors()
                .iter()
                .filter(|e| crate::metrics::classify(e).1 == "map_full")
                .map(|e| e.object.trim_start_matches("service ").to_string())
                .collect();
            assert_eq!(refused.len(), model.refused(), "step {step}");
            for (set, backends) in &want.backend_sets {
                let name = format!("{}/{}", set.service.namespace, set.service.name);
                match model.desired().backend_sets.get(set) {
                    Some(got) => assert_eq!(got, backends, "step {step}: {set:?}"),
                    None => assert!(refused.contains(&name), "step {step}: {name} neither served nor refused"),
                }
            }
        }
        assert!(refusals > 1000 && admitted_later > 50, "refusals {refusals}, admitted later {admitted_later}: maps too big to test anything");
    }
}
