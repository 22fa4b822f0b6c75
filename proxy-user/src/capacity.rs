//! Room in the service maps. Each map has a fixed capacity (`max_entries`,
//! set when it is created: `--service-map-entries`), and the kernel refuses a new key once a map holds
//! that many. Rather than let one oversized Service make every sync fail
//! (and so stop all the others from being programmed), the model admits
//! Services one at a time in a fixed order (`namespace/name`), counting the
//! entries each adds to each map, and refuses whole the first one that would
//! overflow one; the others go on. A refused Service is tried again at every
//! update, so it is programmed once there is room.
//!
//! Entries are counted against what the maps hold now, not against the
//! desired state: the reconciler writes before it removes, so during a sync a
//! map holds its old entries and the new ones at once. A Service already in
//! the maps adds nothing and is never pushed out by a newcomer; room that a
//! sync frees (a Service removed, or shrunk) counts from the next update on,
//! which the agent runs at once when a refused Service waits (see
//! `agent::Syncer`).

use std::{collections::HashSet, fmt};

use ipnet::IpNet;
use proxy_common::{
    FrontendKey, MAP_BACKEND_SLOTS, MAP_BACKENDS, MAP_FRONTENDS, MAP_MAGLEV, MAP_SERVICE_NAMES, MAP_SOURCE_RANGES,
    MAX_BACKEND_SLOTS, MAX_BACKENDS, MAX_FRONTENDS, MAX_MAGLEV_TABLES, MAX_SERVICE_NAMES, MAX_SOURCE_RANGES,
    cluster_ip_marker,
};

use crate::model::{BackendSetKey, BackendTuple, Share};

/// The maps the agent fills per Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServiceMap {
    /// Frontends and ClusterIP markers.
    Frontends,
    /// One name per backend set.
    Names,
    /// One slot per endpoint of each backend set.
    Slots,
    /// Distinct endpoints, shared between Services.
    Backends,
    /// loadBalancerSourceRanges, per backend set.
    SourceRanges,
    /// One Maglev table per Maglev backend set with backends.
    Maglev,
}

impl ServiceMap {
    pub const ALL: [ServiceMap; 6] = [
        ServiceMap::Frontends,
        ServiceMap::Names,
        ServiceMap::Slots,
        ServiceMap::Backends,
        ServiceMap::SourceRanges,
        ServiceMap::Maglev,
    ];

    /// The pinned map's name.
    pub fn name(self) -> &'static str {
        match self {
            ServiceMap::Frontends => MAP_FRONTENDS,
            ServiceMap::Names => MAP_SERVICE_NAMES,
            ServiceMap::Slots => MAP_BACKEND_SLOTS,
            ServiceMap::Backends => MAP_BACKENDS,
            ServiceMap::SourceRanges => MAP_SOURCE_RANGES,
            ServiceMap::Maglev => MAP_MAGLEV,
        }
    }

    /// Its `max_entries` as this build's object declares it (the default
    /// of `--service-map-entries`).
    pub fn default_capacity(self) -> u64 {
        u64::from(match self {
            ServiceMap::Frontends => MAX_FRONTENDS,
            ServiceMap::Names => MAX_SERVICE_NAMES,
            ServiceMap::Slots => MAX_BACKEND_SLOTS,
            ServiceMap::Backends => MAX_BACKENDS,
            ServiceMap::SourceRanges => MAX_SOURCE_RANGES,
            ServiceMap::Maglev => MAX_MAGLEV_TABLES,
        })
    }
}

/// A count per service map, indexed by `ServiceMap as usize`.
pub type Entries = [u64; 6];

/// What the service maps hold now (the reconciler's mirror of them).
pub trait Held {
    fn capacity(&self, map: ServiceMap) -> u64 {
        map.default_capacity()
    }
    /// Entries in each map.
    fn entries(&self) -> Entries;
    fn has_frontend(&self, key: &FrontendKey) -> bool;
    fn has_backend(&self, backend: &BackendTuple) -> bool;
    /// The service ID of a backend set whose name the maps hold.
    fn set_id(&self, set: &BackendSetKey) -> Option<u32>;
    /// How many slots the maps hold for a service ID.
    fn slots(&self, service_id: u32) -> u32;
    fn has_source_range(&self, service_id: u32, net: &IpNet) -> bool;
    /// Whether the maps hold a Maglev table for a service ID.
    fn has_maglev_table(&self, service_id: u32) -> bool;
}

/// Maps without limits, holding nothing: every Service is admitted.
pub struct Unlimited;

impl Held for Unlimited {
    fn capacity(&self, _: ServiceMap) -> u64 {
        u64::MAX
    }
    fn entries(&self) -> Entries {
        [0; 6]
    }
    fn has_frontend(&self, _: &FrontendKey) -> bool {
        false
    }
    fn has_backend(&self, _: &BackendTuple) -> bool {
        false
    }
    fn set_id(&self, _: &BackendSetKey) -> Option<u32> {
        None
    }
    fn slots(&self, _: u32) -> u32 {
        0
    }
    fn has_source_range(&self, _: u32, _: &IpNet) -> bool {
        false
    }
    fn has_maglev_table(&self, _: u32) -> bool {
        false
    }
}

/// Why a Service was refused: the first map (in `ServiceMap` order) it
/// would have overflowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Full {
    pub map: ServiceMap,
    pub capacity: u64,
    /// The Service's own entries in that map (all of them, held or not):
    /// stable while the Service is unchanged, so its report is too.
    pub entries: u64,
}

impl fmt::Display for Full {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "needs {} entries in map {}, which has no room for them (capacity {} entries; map full); \
             not programmed, tried again at every sync",
            self.entries,
            self.map.name(),
            self.capacity
        )
    }
}

/// One pass of admissions: what the maps hold, plus what the Services
/// admitted so far in this pass add.
pub struct Budget<'h, H: Held + ?Sized> {
    held: &'h H,
    used: Entries,
    /// Keys of shared maps that admitted Services add, each counted once.
    frontends: HashSet<FrontendKey>,
    backends: HashSet<BackendTuple>,
}

impl<'h, H: Held + ?Sized> Budget<'h, H> {
    pub fn new(held: &'h H) -> Self {
        Budget { held, used: held.entries(), frontends: HashSet::new(), backends: HashSet::new() }
    }

    /// Admits one Service's share of the desired state if each map has room
    /// for the entries it adds; else says which map would overflow, and
    /// counts nothing of it.
    pub fn admit(&mut self, part: &Share) -> Result<(), Full> {
        let unlimited = ServiceMap::ALL.iter().all(|m| self.held.capacity(*m) == u64::MAX);
        if unlimited {
            return Ok(());
        }
        let mut adds: Entries = [0; 6];
        let markers = part.cluster_ips.iter().map(|ip| cluster_ip_marker((*ip).into()));
        let mut new_frontends: HashSet<FrontendKey> = HashSet::new();
        for key in part.frontends.iter().map(|(key, _)| *key).chain(markers) {
            if !self.held.has_frontend(&key) && !self.frontends.contains(&key) {
                new_frontends.insert(key);
            }
        }
        adds[ServiceMap::Frontends as usize] = new_frontends.len() as u64;
        let mut new_backends: HashSet<BackendTuple> = HashSet::new();
        for (set, backends) in &part.backend_sets {
            let id = self.held.set_id(set);
            let held_slots = id.map_or(0, |id| self.held.slots(id));
            adds[ServiceMap::Names as usize] += u64::from(id.is_none());
            adds[ServiceMap::Slots as usize] += (backends.len() as u64).saturating_sub(u64::from(held_slots));
            for b in backends {
                let t = (b.addr, b.port, b.proto);
                if !self.held.has_backend(&t) && !self.backends.contains(&t) {
                    new_backends.insert(t);
                }
            }
            let nets = part.source_ranges_of(set).into_iter().flatten();
            adds[ServiceMap::SourceRanges as usize] +=
                nets.filter(|net| id.is_none_or(|id| !self.held.has_source_range(id, net))).count() as u64;
            if part.wants_maglev_table(set) {
                adds[ServiceMap::Maglev as usize] += u64::from(id.is_none_or(|id| !self.held.has_maglev_table(id)));
            }
        }
        adds[ServiceMap::Backends as usize] = new_backends.len() as u64;
        for map in ServiceMap::ALL {
            let capacity = self.held.capacity(map);
            if self.used[map as usize].saturating_add(adds[map as usize]) > capacity {
                return Err(Full { map, capacity, entries: own_entries(part, map) });
            }
        }
        for map in ServiceMap::ALL {
            self.used[map as usize] += adds[map as usize];
        }
        self.frontends.extend(new_frontends);
        self.backends.extend(new_backends);
        Ok(())
    }
}

/// Whether the maps have room for every entry of all of `parts`, even if
/// none were held yet and none shared: then each is admitted without
/// counting key by key (the common case, and the cheap one).
pub fn room_for_all<'p>(held: &(impl Held + ?Sized), parts: impl Iterator<Item = &'p Share>) -> bool {
    let mut most = held.entries();
    for part in parts {
        let slots: u64 = part.backend_sets.iter().map(|(_, b)| b.len() as u64).sum();
        let ranges: u64 = part.source_ranges.iter().map(|(_, r)| r.len() as u64).sum();
        let tables = part.backend_sets.iter().filter(|(set, _)| part.wants_maglev_table(set)).count() as u64;
        let adds = [(part.frontends.len() + part.cluster_ips.len()) as u64, part.backend_sets.len() as u64, slots, slots, ranges, tables];
        for (m, n) in most.iter_mut().zip(adds) {
            *m = m.saturating_add(n);
        }
    }
    ServiceMap::ALL.iter().all(|m| most[*m as usize] <= held.capacity(*m))
}

/// Every entry a Service's share puts in `map`, held or not.
fn own_entries(part: &Share, map: ServiceMap) -> u64 {
    let n = match map {
        ServiceMap::Frontends => part.frontends.len() + part.cluster_ips.len(),
        ServiceMap::Names => part.backend_sets.len(),
        ServiceMap::Slots => part.backend_sets.iter().map(|(_, b)| b.len()).sum(),
        ServiceMap::Backends => {
            part.backend_sets.iter().flat_map(|(_, b)| b).map(|b| (b.addr, b.port, b.proto)).collect::<HashSet<_>>().len()
        }
        ServiceMap::SourceRanges => {
            part.backend_sets.iter().filter_map(|(set, _)| part.source_ranges_of(set)).map(Vec::len).sum()
        }
        ServiceMap::Maglev => part.backend_sets.iter().filter(|(set, _)| part.wants_maglev_table(set)).count(),
    };
    n as u64
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, net::IpAddr};

    use proxy_common::{Addr, BACKEND_READY, IPPROTO_TCP, KIND_CLUSTER_IP, KIND_LOAD_BALANCER, POLICY_CLUSTER, SCOPE_INTERNAL};

    use super::*;
    use crate::model::{DesiredBackend, DesiredFrontend, DesiredState, ServicePortName};

    /// Maps with the given capacities holding what `held` lists.
    #[derive(Default)]
    struct Fake {
        capacity: HashMap<ServiceMap, u64>,
        frontends: HashSet<FrontendKey>,
        backends: HashSet<BackendTuple>,
        /// set name -> (id, slots)
        sets: HashMap<String, (u32, u32)>,
        ranges: HashSet<(u32, IpNet)>,
        tables: HashSet<u32>,
    }

    impl Held for Fake {
        fn capacity(&self, map: ServiceMap) -> u64 {
            self.capacity.get(&map).copied().unwrap_or(1000)
        }
        fn entries(&self) -> Entries {
            let slots = self.sets.values().map(|(_, n)| u64::from(*n)).sum();
            [self.frontends.len() as u64, self.sets.len() as u64, slots, self.backends.len() as u64, self.ranges.len() as u64, self.tables.len() as u64]
        }
        fn has_frontend(&self, key: &FrontendKey) -> bool {
            self.frontends.contains(key)
        }
        fn has_backend(&self, b: &BackendTuple) -> bool {
            self.backends.contains(b)
        }
        fn set_id(&self, set: &BackendSetKey) -> Option<u32> {
            self.sets.get(&*set.service.name).map(|(id, _)| *id)
        }
        fn slots(&self, id: u32) -> u32 {
            self.sets.values().find(|(i, _)| *i == id).map_or(0, |(_, n)| *n)
        }
        fn has_source_range(&self, id: u32, net: &IpNet) -> bool {
            self.ranges.contains(&(id, *net))
        }
        fn has_maglev_table(&self, id: u32) -> bool {
            self.tables.contains(&id)
        }
    }

    fn set(name: &str) -> BackendSetKey {
        BackendSetKey {
            service: ServicePortName { namespace: "ns".into(), name: name.into(), port: "".into(), ipv6: false },
            policy: POLICY_CLUSTER,
        }
    }

    fn fk(ip: &str, port: u16) -> FrontendKey {
        FrontendKey { addr: Addr::from(ip.parse::<IpAddr>().unwrap()), port: port.to_be(), proto: IPPROTO_TCP, scope: SCOPE_INTERNAL }
    }

    fn backend(ip: &str) -> DesiredBackend {
        DesiredBackend { addr: ip.parse().unwrap(), port: 8080, proto: IPPROTO_TCP, flags: BACKEND_READY }
    }

    /// A Service `name` on ClusterIP `vip`:80 with `backends`, and as many
    /// source ranges (on an LB frontend) as `ranges`.
    fn part(name: &str, vip: &str, backends: &[&str], ranges: usize) -> Share {
        let mut d = DesiredState::default();
        let s = set(name);
        d.backend_sets.insert(s.clone(), backends.iter().map(|b| backend(b)).collect());
        d.cluster_ips.insert(vip.parse().unwrap());
        d.frontends.insert(fk(vip, 80), DesiredFrontend { set: s.clone(), kind: KIND_CLUSTER_IP, flags: 0, affinity_timeout_s: 0 });
        if ranges > 0 {
            d.frontends.insert(fk("192.0.2.1", 80), DesiredFrontend { set: s.clone(), kind: KIND_LOAD_BALANCER, flags: 0, affinity_timeout_s: 0 });
            let nets = (0..ranges).map(|i| format!("10.{}.{}.0/24", i / 256, i % 256).parse().unwrap()).collect();
            d.source_ranges.insert(s, nets);
        }
        d.into()
    }

    #[test]
    fn admits_until_a_map_would_overflow_then_refuses_whole_and_goes_on() {
        let fake = Fake { capacity: HashMap::from([(ServiceMap::SourceRanges, 100)]), ..Default::default() };
        let mut budget = Budget::new(&fake);
        assert_eq!(budget.admit(&part("a", "10.96.0.1", &["10.0.0.1"], 60)), Ok(()));
        // 60 + 50 > 100: refused, naming the map, its capacity and the Service's own need.
        let full = budget.admit(&part("b", "10.96.0.2", &["10.0.0.2"], 50)).unwrap_err();
        assert_eq!(full, Full { map: ServiceMap::SourceRanges, capacity: 100, entries: 50 });
        assert!(full.to_string().contains("map SOURCE_RANGES") && full.to_string().contains("capacity 100"), "{full}");
        // The refused one counted nothing: the next one that fits is admitted.
        assert_eq!(budget.admit(&part("c", "10.96.0.3", &["10.0.0.3"], 40)), Ok(()));
        assert!(budget.admit(&part("d", "10.96.0.4", &["10.0.0.4"], 1)).is_err(), "exactly full");
        assert_eq!(budget.admit(&part("e", "10.96.0.5", &["10.0.0.5"], 0)), Ok(()), "another map's Service");
    }

    #[test]
    fn a_service_larger_than_a_map_is_refused_even_alone() {
        let fake = Fake { capacity: HashMap::from([(ServiceMap::Slots, 3)]), ..Default::default() };
        let full = Budget::new(&fake).admit(&part("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"], 0)).unwrap_err();
        assert_eq!(full, Full { map: ServiceMap::Slots, capacity: 3, entries: 4 });
    }

    #[test]
    fn what_the_maps_hold_counts_once_and_shared_keys_once() {
        // FRONTENDS has room for 4: a's ClusterIP frontend and marker are held.
        let mut fake = Fake { capacity: HashMap::from([(ServiceMap::Frontends, 4), (ServiceMap::Backends, 2)]), ..Default::default() };
        fake.frontends.extend([fk("10.96.0.1", 80), cluster_ip_marker(Addr::from("10.96.0.1".parse::<IpAddr>().unwrap()))]);
        fake.backends.insert(("10.0.0.1".parse().unwrap(), 8080, IPPROTO_TCP));
        fake.sets.insert("a".into(), (1, 1));
        let mut budget = Budget::new(&fake);
        // Already in the maps: adds nothing, even with the maps at their limit.
        assert_eq!(budget.admit(&part("a", "10.96.0.1", &["10.0.0.1"], 0)), Ok(()));
        // b shares a's backend and adds a second one (backends: 2 of 2).
        assert_eq!(budget.admit(&part("b", "10.96.0.2", &["10.0.0.1", "10.0.0.2"], 0)), Ok(()));
        // c's backend is b's (counted already), but FRONTENDS (4 of 4) is full.
        let full = budget.admit(&part("c", "10.96.0.3", &["10.0.0.2"], 0)).unwrap_err();
        assert_eq!(full.map, ServiceMap::Frontends);
        // d shares b's ClusterIP marker and frontend (a contested key): nothing new there.
        let mut d = part("d", "10.96.0.2", &["10.0.0.2"], 0);
        d.frontends.iter_mut().for_each(|(_, f)| f.set = set("d"));
        assert_eq!(budget.admit(&d), Ok(()));
    }

    #[test]
    fn a_grown_service_counts_only_what_it_adds() {
        let mut fake = Fake { capacity: HashMap::from([(ServiceMap::SourceRanges, 12), (ServiceMap::Slots, 3)]), ..Default::default() };
        fake.sets.insert("a".into(), (7, 2));
        let p = part("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2", "10.0.0.3"], 12);
        for net in p.source_ranges.iter().flat_map(|(_, r)| r).take(10) {
            fake.ranges.insert((7, *net));
        }
        // 10 of its ranges and 2 of its slots held: 2 ranges and 1 slot new, room for both.
        assert_eq!(Budget::new(&fake).admit(&p), Ok(()));
        fake.capacity.insert(ServiceMap::SourceRanges, 11);
        assert_eq!(Budget::new(&fake).admit(&p), Err(Full { map: ServiceMap::SourceRanges, capacity: 11, entries: 12 }));
    }

    #[test]
    fn room_for_all_is_an_upper_bound() {
        let mut fake = Fake { capacity: HashMap::from([(ServiceMap::SourceRanges, 100)]), ..Default::default() };
        let parts = [part("a", "10.96.0.1", &["10.0.0.1"], 60), part("b", "10.96.0.2", &["10.0.0.1"], 40)];
        assert!(room_for_all(&fake, parts.iter()));
        fake.ranges.insert((1, "10.0.0.0/24".parse().unwrap()));
        assert!(!room_for_all(&fake, parts.iter()), "one held entry counts");
        // Then each is counted exactly, in turn.
        let mut budget = Budget::new(&fake);
        assert_eq!(budget.admit(&parts[0]), Ok(()));
        assert!(budget.admit(&parts[1]).is_err());
    }

    #[test]
    fn maglev_tables_count_one_per_set_with_backends() {
        let mut fake = Fake { capacity: HashMap::from([(ServiceMap::Maglev, 1)]), ..Default::default() };
        let maglev = |mut p: Share| {
            p.maglev = p.backend_sets.iter().map(|(s, _)| s.clone()).collect();
            p
        };
        let mut budget = Budget::new(&fake);
        assert_eq!(budget.admit(&maglev(part("a", "10.96.0.1", &["10.0.0.1"], 0))), Ok(()));
        assert_eq!(budget.admit(&maglev(part("e", "10.96.0.5", &[], 0))), Ok(()), "no backends, no table");
        assert_eq!(budget.admit(&part("r", "10.96.0.6", &["10.0.0.6"], 0)), Ok(()), "random: no table");
        let full = budget.admit(&maglev(part("b", "10.96.0.2", &["10.0.0.2"], 0))).unwrap_err();
        assert_eq!(full, Full { map: ServiceMap::Maglev, capacity: 1, entries: 1 });
        assert!(!room_for_all(&fake, [maglev(part("a", "10.96.0.1", &["10.0.0.1"], 0)), maglev(part("b", "10.96.0.2", &["10.0.0.2"], 0))].iter()));
        // A table the maps hold already adds nothing.
        fake.sets.insert("a".into(), (1, 1));
        fake.tables.insert(1);
        assert_eq!(Budget::new(&fake).admit(&maglev(part("a", "10.96.0.1", &["10.0.0.1"], 0))), Ok(()));
    }

    #[test]
    fn unlimited_admits_everything() {
        let mut budget = Budget::new(&Unlimited);
        assert_eq!(budget.admit(&part("a", "10.96.0.1", &["10.0.0.1"], 60_000)), Ok(()));
    }
}
