//! Applies a desired state to the maps with the fewest writes, in an order
//! that never lets a packet see a half-written service: backends before the
//! slots that name them, slots before the count that exposes them, and
//! removals last. IDs come from what the maps already hold, so a restarted
//! agent keeps every service and backend ID and no flow is disturbed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::IpAddr;

use anyhow::{Context, Result};
use ipnet::IpNet;
use proxy_common::{Addr, Backend, FrontendKey, KIND_CLUSTER_IP, ServiceEntry, ServiceName, SlotKey, cluster_ip_marker};

use crate::model::{BackendSetKey, DesiredState};

/// What the maps hold (or, for the reconciler, what it has written).
#[derive(Clone, Default)]
pub struct Contents {
    pub frontends: HashMap<FrontendKey, ServiceEntry>,
    pub slots: HashMap<SlotKey, u32>,
    pub backends: HashMap<u32, Backend>,
    /// service ID -> (`namespace/name:port`, endpoint policy)
    pub names: HashMap<u32, (String, u8)>,
    /// loadBalancerSourceRanges entries: (service ID, allowed prefix).
    pub source_ranges: HashSet<(u32, IpNet)>,
}

/// Writes to the datapath maps. The real one is `maps::Maps`; tests use `Contents`.
pub trait MapWriter {
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<()>;
    fn del_backend(&mut self, id: u32) -> Result<()>;
    fn put_slot(&mut self, key: &SlotKey, backend_id: u32) -> Result<()>;
    fn del_slot(&mut self, key: &SlotKey) -> Result<()>;
    fn put_frontend(&mut self, key: &FrontendKey, entry: &ServiceEntry) -> Result<()>;
    fn del_frontend(&mut self, key: &FrontendKey) -> Result<()>;
    fn put_name(&mut self, id: u32, name: &ServiceName) -> Result<()>;
    fn del_name(&mut self, id: u32) -> Result<()>;
    fn put_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()>;
    fn del_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()>;
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    pub writes: usize,
    pub deletes: usize,
    pub frontends: usize,
    pub backends: usize,
}

pub struct Reconciler {
    /// Mirror of the maps, updated after each successful write.
    held: Contents,
}

type BackendTuple = (IpAddr, u16, u8);

impl Reconciler {
    /// Starts from what the maps already hold (empty on a first start).
    pub fn adopt(held: Contents) -> Self {
        Reconciler { held }
    }

    pub fn held(&self) -> &Contents {
        &self.held
    }

    pub fn sync(&mut self, desired: &DesiredState, maps: &mut impl MapWriter) -> Result<SyncStats> {
        let mut stats = SyncStats::default();
        let service_ids = self.service_ids(desired);
        let backend_states = crate::model::backend_states(desired);
        let backend_ids = self.backend_ids(&backend_states);

        // 1. Backends, and names of new services.
        for (&(addr, port, proto), &id) in &backend_ids {
            let want = Backend { addr: Addr::from(addr), port: port.to_be(), proto, flags: backend_states[&(addr, port, proto)] };
            if self.held.backends.get(&id) != Some(&want) {
                maps.put_backend(id, &want).with_context(|| format!("backend {addr}:{port}"))?;
                self.held.backends.insert(id, want);
                stats.writes += 1;
            }
        }
        for (set, &id) in &service_ids {
            let name = set.service.to_string();
            if self.held.names.get(&id) != Some(&(name.clone(), set.policy)) {
                maps.put_name(id, &ServiceName::new(&name, set.policy))?;
                self.held.names.insert(id, (name, set.policy));
                stats.writes += 1;
            }
        }

        // 2. Slots, then the frontends that expose them.
        for (set, backends) in &desired.backend_sets {
            let service_id = service_ids[set];
            for (slot, b) in backends.iter().enumerate() {
                let key = SlotKey { service_id, slot: slot as u32 };
                let backend_id = backend_ids[&(b.addr, b.port, b.proto)];
                if self.held.slots.get(&key) != Some(&backend_id) {
                    maps.put_slot(&key, backend_id)?;
                    self.held.slots.insert(key, backend_id);
                    stats.writes += 1;
                }
            }
        }
        // Source ranges before the frontends that consult them.
        let want_ranges: HashSet<(u32, IpNet)> =
            desired.source_ranges.iter().flat_map(|(set, nets)| nets.iter().map(|n| (service_ids[set], *n))).collect();
        for r in &want_ranges {
            if !self.held.source_ranges.contains(r) {
                maps.put_source_range(r.0, &r.1)?;
                self.held.source_ranges.insert(*r);
                stats.writes += 1;
            }
        }
        let want_frontends = self.frontend_entries(desired, &service_ids);
        for (key, want) in &want_frontends {
            if self.held.frontends.get(key) != Some(want) {
                maps.put_frontend(key, want).with_context(|| format!("frontend {}:{}", key.addr, u16::from_be(key.port)))?;
                self.held.frontends.insert(*key, *want);
                stats.writes += 1;
            }
        }

        // 3. Removals: frontends, then what stood behind them, then backends.
        let stale: Vec<FrontendKey> = self.held.frontends.keys().filter(|k| !want_frontends.contains_key(k)).copied().collect();
        for key in stale {
            maps.del_frontend(&key)?;
            self.held.frontends.remove(&key);
            stats.deletes += 1;
        }
        let stale: Vec<(u32, IpNet)> = self.held.source_ranges.difference(&want_ranges).copied().collect();
        for r in stale {
            maps.del_source_range(r.0, &r.1)?;
            self.held.source_ranges.remove(&r);
            stats.deletes += 1;
        }
        let slot_counts: HashMap<u32, u32> =
            desired.backend_sets.iter().map(|(set, b)| (service_ids[set], b.len() as u32)).collect();
        let stale: Vec<SlotKey> = self
            .held
            .slots
            .keys()
            .filter(|k| slot_counts.get(&k.service_id).is_none_or(|&n| k.slot >= n))
            .copied()
            .collect();
        for key in stale {
            maps.del_slot(&key)?;
            self.held.slots.remove(&key);
            stats.deletes += 1;
        }
        let live: BTreeSet<u32> = service_ids.values().copied().collect();
        let stale: Vec<u32> = self.held.names.keys().filter(|id| !live.contains(id)).copied().collect();
        for id in stale {
            maps.del_name(id)?;
            self.held.names.remove(&id);
            stats.deletes += 1;
        }
        let live: BTreeSet<u32> = backend_ids.values().copied().collect();
        let stale: Vec<u32> = self.held.backends.keys().filter(|id| !live.contains(id)).copied().collect();
        for id in stale {
            maps.del_backend(id)?;
            self.held.backends.remove(&id);
            stats.deletes += 1;
        }

        stats.frontends = self.held.frontends.len();
        stats.backends = self.held.backends.len();
        Ok(stats)
    }

    /// Every frontend entry the maps should hold: the service frontends, and
    /// a marker per ClusterIP so its unserved ports are rejected.
    fn frontend_entries(&self, desired: &DesiredState, service_ids: &BTreeMap<BackendSetKey, u32>) -> HashMap<FrontendKey, ServiceEntry> {
        let mut entries: HashMap<FrontendKey, ServiceEntry> = desired
            .cluster_ips
            .iter()
            .map(|ip| (cluster_ip_marker(Addr::from(*ip)), ServiceEntry { kind: KIND_CLUSTER_IP, ..Default::default() }))
            .collect();
        for (key, fe) in &desired.frontends {
            let entry = ServiceEntry {
                service_id: service_ids[&fe.set],
                backend_count: desired.backend_sets.get(&fe.set).map_or(0, Vec::len) as u32,
                kind: fe.kind,
                flags: fe.flags,
                affinity_timeout_s: fe.affinity_timeout_s,
                ..Default::default()
            };
            entries.insert(*key, entry);
        }
        entries
    }

    /// Existing IDs by name and endpoint policy; new ones take the lowest free ID.
    fn service_ids(&self, desired: &DesiredState) -> BTreeMap<BackendSetKey, u32> {
        let by_name: HashMap<(&str, u8), u32> =
            self.held.names.iter().map(|(id, (name, policy))| ((name.as_str(), *policy), *id)).collect();
        let mut free = FreeIds::new(self.held.names.keys().copied());
        desired
            .backend_sets
            .keys()
            .map(|set| {
                let id = by_name.get(&(set.service.to_string().as_str(), set.policy)).copied().unwrap_or_else(|| free.take());
                (set.clone(), id)
            })
            .collect()
    }

    /// Existing IDs by address, port and protocol; new ones take the lowest free ID.
    fn backend_ids(&self, backends: &BTreeMap<BackendTuple, u8>) -> BTreeMap<BackendTuple, u32> {
        let by_tuple: HashMap<BackendTuple, u32> =
            self.held.backends.iter().map(|(id, b)| ((b.addr.to_ip(), u16::from_be(b.port), b.proto), *id)).collect();
        let mut free = FreeIds::new(self.held.backends.keys().copied());
        backends
            .keys()
            .map(|&t| (t, by_tuple.get(&t).copied().unwrap_or_else(|| free.take())))
            .collect()
    }
}

/// Hands out the lowest IDs (from 1) not in use. Reusing a freed ID is safe:
/// conntrack checks that a backend ID still names the same address and port.
struct FreeIds {
    used: BTreeSet<u32>,
    next: u32,
}

impl FreeIds {
    fn new(used: impl Iterator<Item = u32>) -> Self {
        FreeIds { used: used.collect(), next: 1 }
    }

    fn take(&mut self) -> u32 {
        while self.used.contains(&self.next) {
            self.next += 1;
        }
        self.used.insert(self.next);
        self.next
    }
}

impl MapWriter for Contents {
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<()> {
        self.backends.insert(id, *backend);
        Ok(())
    }
    fn del_backend(&mut self, id: u32) -> Result<()> {
        self.backends.remove(&id);
        Ok(())
    }
    fn put_slot(&mut self, key: &SlotKey, backend_id: u32) -> Result<()> {
        self.slots.insert(*key, backend_id);
        Ok(())
    }
    fn del_slot(&mut self, key: &SlotKey) -> Result<()> {
        self.slots.remove(key);
        Ok(())
    }
    fn put_frontend(&mut self, key: &FrontendKey, entry: &ServiceEntry) -> Result<()> {
        self.frontends.insert(*key, *entry);
        Ok(())
    }
    fn del_frontend(&mut self, key: &FrontendKey) -> Result<()> {
        self.frontends.remove(key);
        Ok(())
    }
    fn put_name(&mut self, id: u32, name: &ServiceName) -> Result<()> {
        self.names.insert(id, (name.as_str().to_string(), name.policy));
        Ok(())
    }
    fn del_name(&mut self, id: u32) -> Result<()> {
        self.names.remove(&id);
        Ok(())
    }
    fn put_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()> {
        self.source_ranges.insert((service_id, *net));
        Ok(())
    }
    fn del_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()> {
        self.source_ranges.remove(&(service_id, *net));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DesiredBackend, DesiredFrontend, ServicePortName};
    use proxy_common::{BACKEND_READY, IPPROTO_TCP, KIND_CLUSTER_IP, POLICY_CLUSTER, SCOPE_INTERNAL};

    fn set(name: &str) -> BackendSetKey {
        BackendSetKey {
            service: ServicePortName { namespace: "default".into(), name: name.into(), port: "http".into(), ipv6: false },
            policy: POLICY_CLUSTER,
        }
    }

    fn backend(ip: &str) -> DesiredBackend {
        DesiredBackend { addr: ip.parse().unwrap(), port: 8080, proto: IPPROTO_TCP, flags: BACKEND_READY }
    }

    fn frontend(ip: &str) -> FrontendKey {
        FrontendKey { addr: Addr::from(ip.parse::<IpAddr>().unwrap()), port: 80u16.to_be(), proto: IPPROTO_TCP, scope: SCOPE_INTERNAL }
    }

    fn desired(services: &[(&str, &str, &[&str])]) -> DesiredState {
        let mut d = DesiredState::default();
        for (name, vip, backends) in services {
            d.backend_sets.insert(set(name), backends.iter().map(|b| backend(b)).collect());
            d.frontends.insert(frontend(vip), DesiredFrontend { set: set(name), kind: KIND_CLUSTER_IP, flags: 0, affinity_timeout_s: 0 });
        }
        d
    }

    /// The maps resolve every frontend to exactly the desired backends.
    fn resolve(c: &Contents, vip: &str) -> Vec<String> {
        let fe = c.frontends[&frontend(vip)];
        (0..fe.backend_count)
            .map(|slot| {
                let id = c.slots[&SlotKey { service_id: fe.service_id, slot }];
                c.backends[&id].addr.to_string()
            })
            .collect()
    }

    #[test]
    fn applies_then_changes_then_removes_leaving_nothing() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        r.sync(&desired(&[("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]), ("b", "10.96.0.2", &["10.0.0.2"])]), &mut maps).unwrap();
        assert_eq!(resolve(&maps, "10.96.0.1"), ["10.0.0.1", "10.0.0.2"]);
        assert_eq!(resolve(&maps, "10.96.0.2"), ["10.0.0.2"]);
        assert_eq!(maps.backends.len(), 2, "a shared backend is stored once");

        let stats = r.sync(&desired(&[("a", "10.96.0.1", &["10.0.0.2"])]), &mut maps).unwrap();
        assert_eq!(resolve(&maps, "10.96.0.1"), ["10.0.0.2"]);
        assert!(stats.deletes > 0);
        assert_eq!(maps.frontends.len(), 1);
        assert_eq!(maps.slots.len(), 1);
        assert_eq!(maps.backends.len(), 1);
        assert_eq!(maps.names.len(), 1);

        r.sync(&DesiredState::default(), &mut maps).unwrap();
        assert!(maps.frontends.is_empty() && maps.slots.is_empty() && maps.backends.is_empty() && maps.names.is_empty());
    }

    #[test]
    fn same_state_again_writes_nothing() {
        let d = desired(&[("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"])]);
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        r.sync(&d, &mut maps).unwrap();
        assert_eq!(r.sync(&d, &mut maps).unwrap().writes, 0);
    }

    #[test]
    fn a_restarted_reconciler_keeps_ids_and_writes_nothing() {
        let d = desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.3", "10.0.0.4"])]);
        let mut maps = Contents::default();
        Reconciler::adopt(Contents::default()).sync(&d, &mut maps).unwrap();
        let before = (maps.frontends.clone(), maps.backends.clone());

        let mut restarted = Reconciler::adopt(maps.clone());
        let stats = restarted.sync(&d, &mut maps).unwrap();
        assert_eq!((stats.writes, stats.deletes), (0, 0));
        assert_eq!((maps.frontends.clone(), maps.backends.clone()), before);

        // A new service after restart gets a fresh ID, not a taken one.
        let d2 = desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.3", "10.0.0.4"]), ("c", "10.96.0.3", &["10.0.0.5"])]);
        restarted.sync(&d2, &mut maps).unwrap();
        let ids: BTreeSet<u32> = maps.frontends.values().map(|e| e.service_id).collect();
        assert_eq!(ids.len(), 3);
        assert_eq!(resolve(&maps, "10.96.0.2"), ["10.0.0.3", "10.0.0.4"]);
    }

    #[test]
    fn a_failed_write_is_retried_by_the_next_sync() {
        struct FailOnce(Contents, bool);
        impl MapWriter for FailOnce {
            fn put_backend(&mut self, id: u32, b: &Backend) -> Result<()> { self.0.put_backend(id, b) }
            fn del_backend(&mut self, id: u32) -> Result<()> { self.0.del_backend(id) }
            fn put_slot(&mut self, k: &SlotKey, v: u32) -> Result<()> {
                if std::mem::take(&mut self.1) { anyhow::bail!("map full") }
                self.0.put_slot(k, v)
            }
            fn del_slot(&mut self, k: &SlotKey) -> Result<()> { self.0.del_slot(k) }
            fn put_frontend(&mut self, k: &FrontendKey, e: &ServiceEntry) -> Result<()> { self.0.put_frontend(k, e) }
            fn del_frontend(&mut self, k: &FrontendKey) -> Result<()> { self.0.del_frontend(k) }
            fn put_name(&mut self, id: u32, n: &ServiceName) -> Result<()> { self.0.put_name(id, n) }
            fn del_name(&mut self, id: u32) -> Result<()> { self.0.del_name(id) }
            fn put_source_range(&mut self, id: u32, n: &IpNet) -> Result<()> { self.0.put_source_range(id, n) }
            fn del_source_range(&mut self, id: u32, n: &IpNet) -> Result<()> { self.0.del_source_range(id, n) }
        }
        let d = desired(&[("a", "10.96.0.1", &["10.0.0.1"])]);
        let mut maps = FailOnce(Contents::default(), true);
        let mut r = Reconciler::adopt(Contents::default());
        assert!(r.sync(&d, &mut maps).is_err());
        assert!(maps.0.frontends.is_empty(), "no frontend may point at unwritten slots");
        r.sync(&d, &mut maps).unwrap();
        assert_eq!(resolve(&maps.0, "10.96.0.1"), ["10.0.0.1"]);
    }
}
