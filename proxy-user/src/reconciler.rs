//! Applies a desired state to the maps with the fewest writes, in an order
//! that never lets a packet see a half-written service: backends before the
//! slots that name them (or beside them, while no frontend exposes any
//! slot), slots before the count that exposes them, and
//! removals last; a Maglev table before the frontends that use it, and
//! away only after they stopped. IDs come from what the maps already hold, so a restarted
//! agent keeps every service and backend ID and no flow is disturbed. The
//! service CIDRs, a handful of prefixes, are compared whole on every sync.
//!
//! IDs are reused, lowest free first, but never while an AFFINITY entry
//! may name them: a sync that takes a backend out of a service's set, or
//! frees an ID, then deletes every affinity entry whose backend is not in
//! its service's current set, and only then may the freed IDs be handed
//! out again (see `purge_affinity`).

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::IpAddr,
};

use anyhow::{Context, Result};
use ipnet::IpNet;
use proxy_common::{
    Addr, AffinityEntry, AffinityKey, Backend, FrontendKey, KIND_CLUSTER_IP, ServiceEntry, ServiceName, SlotKey,
    cluster_ip_marker,
};

use crate::{
    incremental::Touched,
    maglev::MaglevParams,
    maps::{Contents, MapWriter, in_order},
    model::{BackendSetKey, BackendTuple, DesiredState},
};

/// What a Maglev table was built from: its backends and their IDs, in
/// order. None: adopted from the maps, unknown (rewritten at the first sync).
type TableSource = Option<Vec<(BackendTuple, u32)>>;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SyncStats {
    pub writes: usize,
    pub deletes: usize,
    pub frontends: usize,
    pub backends: usize,
    /// AFFINITY entries deleted: they named a backend no longer in their
    /// service's set (or a freed ID).
    pub affinity_purged: usize,
}

pub struct Reconciler {
    /// Mirror of the maps, updated after each successful write.
    held: Contents,
    /// Indexes of `held`: the ID of each service (by name and endpoint
    /// policy) and backend, the IDs in use, and each service's slot count.
    service_ids: HashMap<(String, u8), u32>,
    backend_ids: HashMap<BackendTuple, u32>,
    free_service_ids: FreeIds,
    free_backend_ids: FreeIds,
    slot_counts: HashMap<u32, u32>,
    /// A slot lost its backend, or an ID was freed, since AFFINITY was last
    /// purged (or the maps were adopted, with whatever entries a previous
    /// agent left): some entry may name a backend its service no longer has.
    affinity_purge_due: bool,
    /// A frontend with ClientIP affinity was in the maps since the last
    /// purge, so programs may be writing entries while it runs.
    affinity_served: bool,
    /// Each service map's `max_entries` (`crate::capacity::ServiceMap` order).
    capacity: crate::capacity::Entries,
    /// The seed and size Maglev tables are built with.
    maglev: MaglevParams,
    /// The Maglev tables the maps hold, by service ID (the mirror keeps
    /// what each was built from, not its 64 KiB).
    tables: HashMap<u32, TableSource>,
}

impl Reconciler {
    /// Starts from what the maps already hold (empty on a first start).
    pub fn adopt(held: Contents) -> Self {
        let service_ids = held.names.iter().map(|(id, (name, policy))| ((name.clone(), *policy), *id)).collect();
        let backend_ids = held.backends.iter().map(|(id, b)| ((b.addr.to_ip(), u16::from_be(b.port), b.proto), *id)).collect();
        let mut held = held;
        let tables = std::mem::take(&mut held.maglev).into_keys().map(|id| (id, None)).collect();
        let mut slot_counts: HashMap<u32, u32> = HashMap::new();
        for k in held.slots.keys() {
            let n = slot_counts.entry(k.service_id).or_default();
            *n = (*n).max(k.slot + 1);
        }
        Reconciler {
            free_service_ids: FreeIds::new(held.names.keys().copied()),
            free_backend_ids: FreeIds::new(held.backends.keys().copied()),
            held,
            service_ids,
            backend_ids,
            slot_counts,
            // A previous agent may have freed IDs that entries still name
            // (stopped before its purge, or an older build): no ID is handed
            // out before the first purge (`sync` starts with it).
            affinity_purge_due: true,
            affinity_served: true,
            capacity: crate::capacity::ServiceMap::ALL.map(crate::capacity::ServiceMap::default_capacity),
            maglev: MaglevParams::default(),
            tables,
        }
    }

    /// Builds Maglev tables with this seed and size (the programs' globals).
    pub fn with_maglev(mut self, maglev: MaglevParams) -> Self {
        self.maglev = maglev;
        self
    }

    /// Admits Services against these capacities (the maps' own, which
    /// `--service-map-entries` or an older pin set) rather than the defaults.
    pub fn within(mut self, capacity: crate::capacity::Entries) -> Self {
        self.capacity = capacity;
        self
    }

    pub fn held(&self) -> &Contents {
        &self.held
    }

    /// Makes the maps hold `desired`, looking at every entry.
    pub fn sync(&mut self, desired: &DesiredState, maps: &mut impl MapWriter) -> Result<SyncStats> {
        let leftover = self.purge_affinity(maps)?;
        let everything = Keys {
            sets: desired.backend_sets.keys().collect(),
            frontends: desired.frontends.keys().copied().collect(),
            cluster_ips: desired.cluster_ips.iter().copied().collect(),
            backends: desired.backends.iter().map(|(t, flags)| (*t, Some(*flags))).collect(),
        };
        let applied = self.apply(desired, &everything, maps).and_then(|(mut stats, set_ids)| {
            stats.deletes += self.remove_unwanted(desired, &set_ids, maps)?;
            Ok(stats)
        });
        self.finish(applied, leftover, maps)
    }

    /// Like `sync`, looking only at the entries of `touched`: everything
    /// else must already be as `desired` says (the last sync succeeded, and
    /// `touched` holds every key that changed since).
    pub fn sync_touched(&mut self, desired: &DesiredState, touched: &Touched, maps: &mut impl MapWriter) -> Result<SyncStats> {
        let leftover = self.purge_affinity(maps)?;
        let keys = Keys {
            sets: touched.sets.iter().collect(),
            frontends: touched.frontends.iter().copied().collect(),
            cluster_ips: touched.cluster_ips.iter().copied().collect(),
            backends: touched.backends.iter().map(|t| (*t, desired.backends.get(t).copied())).collect(),
        };
        let applied = self.apply(desired, &keys, maps).map(|(stats, _)| stats);
        self.finish(applied, leftover, maps)
    }

    /// After a sync's writes (whether or not all succeeded): AFFINITY purged
    /// of what they removed, the freed IDs reopened, the totals.
    fn finish(&mut self, applied: Result<SyncStats>, leftover: usize, maps: &mut impl MapWriter) -> Result<SyncStats> {
        let purged = self.purge_affinity(maps);
        let mut stats = applied?;
        stats.affinity_purged = leftover + purged?;
        stats.frontends = self.held.frontends.len();
        stats.backends = self.held.backends.len();
        Ok(stats)
    }

    /// If a removal is pending: deletes every AFFINITY entry whose backend
    /// is not in its service's current set (`held`, which the maps hold),
    /// then hands the IDs freed before it out again. Covers every way an
    /// entry goes stale: its backend left the set (while the ID lives on in
    /// another service's set), its backend ID or its service ID was freed
    /// (no slot names them) — so a reused ID never inherits an entry and a
    /// sticky client never follows an ID to another Service's pod.
    fn purge_affinity(&mut self, maps: &mut impl MapWriter) -> Result<usize> {
        if !self.affinity_purge_due {
            return Ok(0);
        }
        let (slots, counts) = (&self.held.slots, &self.slot_counts);
        // Each service's backends, built for the services entries name.
        let mut sets: HashMap<u32, HashSet<u32>> = HashMap::new();
        let mut stale = |key: &AffinityKey, entry: &AffinityEntry| {
            let set = sets.entry(key.service_id).or_insert_with(|| {
                let n = counts.get(&key.service_id).copied().unwrap_or(0);
                (0..n).filter_map(|slot| slots.get(&SlotKey { service_id: key.service_id, slot }).copied()).collect()
            });
            !set.contains(&entry.backend_id)
        };
        let purged = maps.purge_affinity(self.affinity_served, &mut stale).context("purging stale session affinity entries")?;
        self.affinity_purge_due = false;
        self.affinity_served = self.held.frontends.values().any(|e| e.affinity_timeout_s != 0);
        self.free_service_ids.reopen();
        self.free_backend_ids.reopen();
        Ok(purged)
    }

    /// Writes and removes the entries of the `touched` keys.
    /// Also returns the IDs of the touched sets that are wanted.
    fn apply<'k>(
        &mut self,
        desired: &DesiredState,
        touched: &Keys<'k>,
        maps: &mut impl MapWriter,
    ) -> Result<(SyncStats, HashMap<&'k BackendSetKey, u32>)> {
        let mut stats = SyncStats::default();

        // 1. Backends, names of new services and their slots: IDs first
        // (a new one is taken now and given back if its write fails), then
        // the writes, all three at once while no frontend can reach them.
        let mut tuples = Vec::new();
        let mut backend_writes = Vec::new();
        for (t, wanted) in &touched.backends {
            let (Some(flags), &(addr, port, proto)) = (*wanted, t) else { continue };
            let id = match self.backend_ids.get(t) {
                Some(id) => *id,
                None => {
                    let id = self.free_backend_ids.take();
                    self.backend_ids.insert(*t, id);
                    id
                }
            };
            let want = Backend { addr: Addr::from(addr), port: port.to_be(), proto, flags };
            if self.held.backends.get(&id) != Some(&want) {
                tuples.push(t);
                backend_writes.push((id, want));
            }
        }
        let mut set_ids: HashMap<&BackendSetKey, u32> = HashMap::new();
        let mut named = Vec::new();
        let mut name_writes = Vec::new();
        for &set in touched.sets.iter().filter(|s| desired.backend_sets.contains_key(**s)) {
            let name = set.service.to_string();
            let id = match self.service_ids.get(&(name.clone(), set.policy)) {
                Some(&id) => id,
                None => {
                    let id = self.free_service_ids.take();
                    name_writes.push((id, ServiceName::new(&name, set.policy)));
                    named.push((set, name));
                    id
                }
            };
            set_ids.insert(set, id);
        }
        let mut services = Vec::new();
        let mut slot_writes = Vec::new();
        for (&set, &service_id) in &set_ids {
            for (slot, b) in desired.backend_sets[set].iter().enumerate() {
                let key = SlotKey { service_id, slot: slot as u32 };
                let backend_id = self.backend_ids[&(b.addr, b.port, b.proto)];
                if self.held.slots.get(&key) != Some(&backend_id) {
                    services.push(&set.service);
                    slot_writes.push((key, backend_id));
                }
            }
        }
        let [(backends_written, backends_result), (names_written, names_result), (slots_written, slots_result)] =
            if self.held.frontends.is_empty() {
                maps.put_unexposed(&backend_writes, &name_writes, &slot_writes)
            } else {
                in_order(maps, &backend_writes, &name_writes, &slot_writes)
            };
        // The mirror takes what each map holds now, whatever failed.
        self.held.backends.reserve(backends_written);
        for &(id, want) in &backend_writes[..backends_written] {
            self.held.backends.insert(id, want);
            stats.writes += 1;
        }
        for (&t, &(id, _)) in tuples.iter().zip(&backend_writes).skip(backends_written) {
            // Taken for this write and never written: nothing names it.
            if !self.held.backends.contains_key(&id) {
                self.backend_ids.remove(t);
                self.free_backend_ids.give_back(id);
            }
        }
        for ((set, name), &(id, _)) in named.iter().zip(&name_writes).take(names_written) {
            self.held.names.insert(id, (name.clone(), set.policy));
            self.service_ids.insert((name.clone(), set.policy), id);
            stats.writes += 1;
        }
        for &(id, _) in &name_writes[names_written..] {
            self.free_service_ids.give_back(id);
        }
        self.held.slots.reserve(slots_written);
        for &(key, backend_id) in &slot_writes[..slots_written] {
            // The slot's previous backend may have left the set.
            self.affinity_purge_due |= self.held.slots.insert(key, backend_id).is_some();
            let n = self.slot_counts.entry(key.service_id).or_default();
            *n = (*n).max(key.slot + 1);
            stats.writes += 1;
        }
        if let Err(e) = backends_result {
            let (addr, port, _) = tuples[backends_written];
            return Err(e).with_context(|| format!("backend {addr}:{port}"));
        }
        if let Err(e) = names_result {
            return Err(e).with_context(|| format!("service {}", named[names_written].1));
        }
        if let Err(e) = slots_result {
            return Err(e).with_context(|| format!("service {}: backend slot {}", services[slots_written], slot_writes[slots_written].0.slot));
        }
        // 2. Maglev tables before the frontends flagged to read them: each
        // written whole, in one update, when its backends changed.
        for (&set, &service_id) in &set_ids {
            if !desired.wants_maglev_table(set) {
                continue;
            }
            let members: Vec<(BackendTuple, u32)> = desired.backend_sets[set]
                .iter()
                .map(|b| ((b.addr, b.port, b.proto), self.backend_ids[&(b.addr, b.port, b.proto)]))
                .collect();
            if self.tables.get(&service_id).is_some_and(|held| held.as_ref() == Some(&members)) {
                continue;
            }
            let table = self.maglev.table(&members).expect("a set with backends has a table");
            maps.put_maglev(service_id, &table).with_context(|| format!("service {}: Maglev table", set.service))?;
            self.tables.insert(service_id, Some(members));
            stats.writes += 1;
        }
        // Source ranges before the frontends that consult them.
        let mut want_ranges: HashSet<(u32, IpNet)> = HashSet::new();
        for (&set, &id) in &set_ids {
            want_ranges.extend(desired.source_ranges.get(set).into_iter().flatten().map(|n| (id, *n)));
        }
        let set_of = |id: u32| set_ids.iter().find(|(_, i)| **i == id).map(|(set, _)| set.service.to_string()).unwrap_or_default();
        for r in &want_ranges {
            if !self.held.source_ranges.contains(r) {
                maps.put_source_range(r.0, &r.1).with_context(|| format!("service {}: source range {}", set_of(r.0), r.1))?;
                self.held.source_ranges.insert(*r);
                stats.writes += 1;
            }
        }
        let mut stale_frontends = Vec::new();
        let mut writes = Vec::new();
        let markers = touched.cluster_ips.iter().map(|ip| cluster_ip_marker(Addr::from(*ip)));
        for key in touched.frontends.iter().copied().chain(markers) {
            match self.frontend_entry(desired, &set_ids, &key) {
                Some(want) if self.held.frontends.get(&key) != Some(&want) => writes.push((key, want)),
                Some(_) => {}
                None => stale_frontends.push(key),
            }
        }
        let (written, result) = maps.put_frontends(&writes);
        for &(key, want) in writes.iter().take(written) {
            self.held.frontends.insert(key, want);
            self.affinity_served |= want.affinity_timeout_s != 0;
            stats.writes += 1;
        }
        if let Err(e) = result {
            let key = writes[written].0;
            return Err(e).with_context(|| format!("frontend {}:{}", key.addr, u16::from_be(key.port)));
        }

        // Service CIDRs after the frontends, so an address that just became
        // a ClusterIP in a new CIDR is never dropped on the way.
        for net in desired.service_cidrs.difference(&self.held.service_cidrs).copied().collect::<Vec<_>>() {
            maps.put_service_cidr(&net).with_context(|| format!("service CIDR {net}"))?;
            self.held.service_cidrs.insert(net);
            stats.writes += 1;
        }

        // 3. Removals: frontends, then what stood behind them, then backends.
        for key in stale_frontends {
            if self.held.frontends.contains_key(&key) {
                maps.del_frontend(&key)?;
                self.held.frontends.remove(&key);
                stats.deletes += 1;
            }
        }
        let mut ids_of_touched: HashSet<u32> = set_ids.values().copied().collect();
        let unwanted = touched.sets.iter().filter(|set| !set_ids.contains_key(**set));
        ids_of_touched.extend(unwanted.filter_map(|set| self.service_ids.get(&(set.service.to_string(), set.policy)).copied()));
        let stale: Vec<(u32, IpNet)> = self
            .held
            .source_ranges
            .iter()
            .filter(|r| ids_of_touched.contains(&r.0) && !want_ranges.contains(r))
            .copied()
            .collect();
        for r in stale {
            maps.del_source_range(r.0, &r.1)?;
            self.held.source_ranges.remove(&r);
            stats.deletes += 1;
        }
        for &set in &touched.sets {
            if let Some(&id) = set_ids.get(set) {
                stats.deletes += self.trim_slots(id, desired.backend_sets[set].len() as u32, maps)?;
                if !desired.wants_maglev_table(set) {
                    stats.deletes += self.drop_table(id, maps)?;
                }
                continue;
            }
            let name = set.service.to_string();
            let Some(&id) = self.service_ids.get(&(name.clone(), set.policy)) else { continue };
            stats.deletes += self.trim_slots(id, 0, maps)?;
            stats.deletes += self.drop_table(id, maps)?;
            maps.del_name(id)?;
            self.held.names.remove(&id);
            self.service_ids.remove(&(name, set.policy));
            self.free_service_ids.release(id);
            self.affinity_purge_due = true;
            stats.deletes += 1;
        }
        for net in self.held.service_cidrs.difference(&desired.service_cidrs).copied().collect::<Vec<_>>() {
            maps.del_service_cidr(&net).with_context(|| format!("service CIDR {net}"))?;
            self.held.service_cidrs.remove(&net);
            stats.deletes += 1;
        }
        for (t, wanted) in &touched.backends {
            if wanted.is_some() {
                continue;
            }
            let Some(&id) = self.backend_ids.get(t) else { continue };
            maps.del_backend(id)?;
            self.held.backends.remove(&id);
            self.backend_ids.remove(t);
            self.free_backend_ids.release(id);
            self.affinity_purge_due = true;
            stats.deletes += 1;
        }
        Ok((stats, set_ids))
    }

    /// Removes every held entry `desired` does not name (including ones a
    /// previous agent left that no touched key reaches); `set_ids` holds
    /// the ID of every wanted set.
    fn remove_unwanted(&mut self, desired: &DesiredState, set_ids: &HashMap<&BackendSetKey, u32>, maps: &mut impl MapWriter) -> Result<usize> {
        let mut deletes = 0;
        let wanted = |k: &FrontendKey| {
            desired.frontends.contains_key(k) || (*k == cluster_ip_marker(k.addr) && desired.cluster_ips.contains(&k.addr.to_ip()))
        };
        let stale: Vec<FrontendKey> = self.held.frontends.keys().filter(|k| !wanted(k)).copied().collect();
        for key in stale {
            maps.del_frontend(&key)?;
            self.held.frontends.remove(&key);
            deletes += 1;
        }
        let live: HashMap<u32, &BackendSetKey> = set_ids.iter().map(|(set, id)| (*id, *set)).collect();
        let stale: Vec<(u32, IpNet)> = self
            .held
            .source_ranges
            .iter()
            .filter(|(id, net)| live.get(id).and_then(|set| desired.source_ranges.get(*set)).is_none_or(|nets| !nets.contains(net)))
            .copied()
            .collect();
        for r in stale {
            maps.del_source_range(r.0, &r.1)?;
            self.held.source_ranges.remove(&r);
            deletes += 1;
        }
        let ids: Vec<u32> = self.slot_counts.keys().copied().collect();
        for id in ids {
            let keep = live.get(&id).map_or(0, |set| desired.backend_sets[*set].len() as u32);
            deletes += self.trim_slots(id, keep, maps)?;
        }
        let stale: Vec<u32> =
            self.tables.keys().filter(|id| live.get(id).is_none_or(|set| !desired.wants_maglev_table(set))).copied().collect();
        for id in stale {
            deletes += self.drop_table(id, maps)?;
        }
        let stale: Vec<u32> = self.held.names.keys().filter(|id| !live.contains_key(id)).copied().collect();
        for id in stale {
            maps.del_name(id)?;
            if let Some(key) = self.held.names.remove(&id) {
                self.service_ids.remove(&key);
            }
            self.free_service_ids.release(id);
            self.affinity_purge_due = true;
            deletes += 1;
        }
        // `apply` gave every wanted backend an ID: as many IDs, none stale.
        let stale: Vec<(BackendTuple, u32)> = if self.backend_ids.len() == desired.backends.len() {
            Vec::new()
        } else {
            self.backend_ids.iter().filter(|(t, _)| !desired.backends.contains_key(*t)).map(|(t, id)| (*t, *id)).collect()
        };
        for (t, id) in stale {
            maps.del_backend(id)?;
            self.held.backends.remove(&id);
            self.backend_ids.remove(&t);
            self.free_backend_ids.release(id);
            self.affinity_purge_due = true;
            deletes += 1;
        }
        Ok(deletes)
    }

    /// Deletes a service's Maglev table, if the maps hold one.
    fn drop_table(&mut self, service_id: u32, maps: &mut impl MapWriter) -> Result<usize> {
        if !self.tables.contains_key(&service_id) {
            return Ok(0);
        }
        maps.del_maglev(service_id)?;
        self.tables.remove(&service_id);
        Ok(1)
    }

    /// Deletes a service's slots from `keep` on.
    fn trim_slots(&mut self, service_id: u32, keep: u32, maps: &mut impl MapWriter) -> Result<usize> {
        let Some(&held) = self.slot_counts.get(&service_id) else { return Ok(0) };
        let mut deletes = 0;
        for slot in keep..held {
            let key = SlotKey { service_id, slot };
            if self.held.slots.contains_key(&key) {
                maps.del_slot(&key)?;
                self.held.slots.remove(&key);
                self.affinity_purge_due = true;
                deletes += 1;
            }
        }
        if keep == 0 {
            self.slot_counts.remove(&service_id);
        } else {
            self.slot_counts.insert(service_id, keep);
        }
        Ok(deletes)
    }

    /// The entry a frontend key should hold: a service frontend, or the
    /// marker of a ClusterIP (so its unserved ports are rejected).
    fn frontend_entry(&self, desired: &DesiredState, set_ids: &HashMap<&BackendSetKey, u32>, key: &FrontendKey) -> Option<ServiceEntry> {
        if let Some(fe) = desired.frontends.get(key) {
            let service_id = match set_ids.get(&fe.set) {
                Some(id) => *id,
                None => *self.service_ids.get(&(fe.set.service.to_string(), fe.set.policy))?,
            };
            return Some(ServiceEntry {
                service_id,
                backend_count: desired.backend_sets.get(&fe.set).map_or(0, Vec::len) as u32,
                kind: fe.kind,
                flags: fe.flags,
                affinity_timeout_s: fe.affinity_timeout_s,
                ..Default::default()
            });
        }
        (*key == cluster_ip_marker(key.addr) && desired.cluster_ips.contains(&key.addr.to_ip()))
            .then(|| ServiceEntry { kind: KIND_CLUSTER_IP, ..Default::default() })
    }
}

/// What the maps hold, for admitting Services (`capacity`).
impl crate::capacity::Held for Reconciler {
    fn capacity(&self, map: crate::capacity::ServiceMap) -> u64 {
        self.capacity[map as usize]
    }
    fn entries(&self) -> crate::capacity::Entries {
        let h = &self.held;
        [h.frontends.len(), h.names.len(), h.slots.len(), h.backends.len(), h.source_ranges.len(), self.tables.len()]
            .map(|n| n as u64)
    }
    fn has_frontend(&self, key: &FrontendKey) -> bool {
        self.held.frontends.contains_key(key)
    }
    fn has_backend(&self, backend: &BackendTuple) -> bool {
        self.backend_ids.contains_key(backend)
    }
    fn set_id(&self, set: &BackendSetKey) -> Option<u32> {
        self.service_ids.get(&(set.service.to_string(), set.policy)).copied()
    }
    fn slots(&self, service_id: u32) -> u32 {
        self.slot_counts.get(&service_id).copied().unwrap_or(0)
    }
    fn has_source_range(&self, service_id: u32, net: &IpNet) -> bool {
        self.held.source_ranges.contains(&(service_id, *net))
    }
    fn has_maglev_table(&self, service_id: u32) -> bool {
        self.tables.contains_key(&service_id)
    }
}

/// The keys a sync looks at.
struct Keys<'k> {
    sets: Vec<&'k BackendSetKey>,
    frontends: Vec<FrontendKey>,
    cluster_ips: Vec<IpAddr>,
    /// With each backend's flags, if `desired` still has it.
    backends: Vec<(BackendTuple, Option<u8>)>,
}

/// Hands out the lowest IDs (from 1) not in use. A freed ID stays out of
/// use (quarantined) until `reopen`, which the reconciler calls once it has
/// purged every AFFINITY entry that could name it: an entry never outlives
/// its ID into the ID's next life. Conntrack entries name backend IDs too,
/// but only to notice a removal: a flow is sent to the address in its own
/// entry, and is balanced again once its ID names another address.
struct FreeIds {
    used: BTreeSet<u32>,
    /// Freed, still in `used` until `reopen`.
    quarantined: Vec<u32>,
    /// No ID below this is free.
    next: u32,
}

impl FreeIds {
    fn new(used: impl Iterator<Item = u32>) -> Self {
        FreeIds { used: used.collect(), quarantined: Vec::new(), next: 1 }
    }

    fn take(&mut self) -> u32 {
        while self.used.contains(&self.next) {
            self.next += 1;
        }
        self.used.insert(self.next);
        self.next
    }

    /// An ID the maps no longer hold: free after the next `reopen`.
    fn release(&mut self, id: u32) {
        self.quarantined.push(id);
    }

    /// An ID just taken whose first write failed: nothing can name it.
    fn give_back(&mut self, id: u32) {
        self.used.remove(&id);
        self.next = self.next.min(id.max(1));
    }

    /// Frees every quarantined ID.
    fn reopen(&mut self) {
        for id in std::mem::take(&mut self.quarantined) {
            self.give_back(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::model::{DesiredBackend, DesiredFrontend, ServicePortName};
    use proxy_common::{
        BACKEND_READY, IPPROTO_TCP, KIND_CLUSTER_IP, MAGLEV_TABLE_MAX, MaglevTable, POLICY_CLUSTER, SCOPE_INTERNAL, SVC_MAGLEV,
    };

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
        d.backends = crate::model::backend_states(&d);
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
    fn service_cidrs_are_compared_whole_by_every_sync() {
        let nets = |list: &[&str]| list.iter().map(|n| n.parse().unwrap()).collect::<BTreeSet<IpNet>>();
        let with = |cidrs: &[&str]| DesiredState { service_cidrs: nets(cidrs), ..desired(&[("a", "10.96.0.1", &["10.0.0.1"])]) };
        // A previous agent's CIDRs, adopted: the first sync replaces them.
        let mut maps = Contents { service_cidrs: nets(&["172.30.0.0/16"]), ..Default::default() };
        let mut r = Reconciler::adopt(maps.clone());
        r.sync(&with(&["10.96.0.0/16", "fd00:10:96::/112"]), &mut maps).unwrap();
        assert_eq!(maps.service_cidrs, nets(&["10.96.0.0/16", "fd00:10:96::/112"]));
        // An incremental sync that touched no key still applies a CIDR change.
        let stats = r.sync_touched(&with(&["10.96.0.0/16", "10.97.0.0/16"]), &Touched::default(), &mut maps).unwrap();
        assert_eq!(maps.service_cidrs, nets(&["10.96.0.0/16", "10.97.0.0/16"]));
        assert_eq!((stats.writes, stats.deletes), (1, 1));
        assert_eq!(r.sync_touched(&with(&["10.96.0.0/16", "10.97.0.0/16"]), &Touched::default(), &mut maps).unwrap().writes, 0);
        r.sync(&DesiredState::default(), &mut maps).unwrap();
        assert!(maps.service_cidrs.is_empty());
    }

    /// Contents whose next slot write fails (`slot`), or whose name or
    /// backend write fails after `names_ok` / `backends_ok` more succeed.
    /// `at_once`: writes backends, names and slots of unexposed services
    /// whatever fails, as the pinned maps do on two threads.
    #[derive(Default)]
    struct FailOnce {
        maps: Contents,
        slot: bool,
        names_ok: Option<usize>,
        backends_ok: Option<usize>,
        at_once: bool,
    }

    /// Fails once the count of writes still to succeed is down to 0.
    fn count_down(ok: &mut Option<usize>) -> Result<()> {
        match ok {
            Some(0) => {
                *ok = None;
                anyhow::bail!("map full")
            }
            Some(left) => *left -= 1,
            None => {}
        }
        Ok(())
    }

    impl MapWriter for FailOnce {
        fn put_backend(&mut self, id: u32, b: &Backend) -> Result<()> {
            count_down(&mut self.backends_ok)?;
            self.maps.put_backend(id, b)
        }
        fn del_backend(&mut self, id: u32) -> Result<()> { self.maps.del_backend(id) }
        fn put_slot(&mut self, k: &SlotKey, v: u32) -> Result<()> {
            if std::mem::take(&mut self.slot) { anyhow::bail!("map full") }
            self.maps.put_slot(k, v)
        }
        fn del_slot(&mut self, k: &SlotKey) -> Result<()> { self.maps.del_slot(k) }
        fn put_frontend(&mut self, k: &FrontendKey, e: &ServiceEntry) -> Result<()> { self.maps.put_frontend(k, e) }
        fn del_frontend(&mut self, k: &FrontendKey) -> Result<()> { self.maps.del_frontend(k) }
        fn put_name(&mut self, id: u32, n: &ServiceName) -> Result<()> {
            count_down(&mut self.names_ok)?;
            self.maps.put_name(id, n)
        }
        fn del_name(&mut self, id: u32) -> Result<()> { self.maps.del_name(id) }
        fn put_maglev(&mut self, id: u32, t: &MaglevTable) -> Result<()> { self.maps.put_maglev(id, t) }
        fn del_maglev(&mut self, id: u32) -> Result<()> { self.maps.del_maglev(id) }
        fn put_source_range(&mut self, id: u32, n: &IpNet) -> Result<()> { self.maps.put_source_range(id, n) }
        fn del_source_range(&mut self, id: u32, n: &IpNet) -> Result<()> { self.maps.del_source_range(id, n) }
        fn put_service_cidr(&mut self, n: &IpNet) -> Result<()> { self.maps.put_service_cidr(n) }
        fn del_service_cidr(&mut self, n: &IpNet) -> Result<()> { self.maps.del_service_cidr(n) }
        fn purge_affinity(&mut self, settle: bool, stale: &mut dyn FnMut(&AffinityKey, &AffinityEntry) -> bool) -> Result<usize> {
            self.maps.purge_affinity(settle, stale)
        }
        fn put_unexposed(&mut self, b: &[(u32, Backend)], n: &[(u32, ServiceName)], s: &[(SlotKey, u32)]) -> [(usize, Result<()>); 3] {
            if !self.at_once {
                return in_order(self, b, n, s);
            }
            [self.put_backends(b), self.put_names(n), self.put_slots(s)]
        }
    }

    #[test]
    fn a_failed_write_is_retried_by_the_next_sync() {
        let d = desired(&[("a", "10.96.0.1", &["10.0.0.1"])]);
        let mut maps = FailOnce { slot: true, ..Default::default() };
        let mut r = Reconciler::adopt(Contents::default());
        assert!(r.sync(&d, &mut maps).is_err());
        assert!(maps.maps.frontends.is_empty(), "no frontend may point at unwritten slots");
        r.sync(&d, &mut maps).unwrap();
        assert_eq!(resolve(&maps.maps, "10.96.0.1"), ["10.0.0.1"]);
    }

    #[test]
    fn a_failed_name_write_hands_back_the_ids_it_did_not_write() {
        let d = desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.2"]), ("c", "10.96.0.3", &["10.0.0.3"])]);
        let mut maps = FailOnce { names_ok: Some(1), ..Default::default() };
        let mut r = Reconciler::adopt(Contents::default());
        let e = r.sync(&d, &mut maps).unwrap_err();
        assert!(format!("{e:#}").contains("map full"), "{e:#}");
        assert_eq!(maps.maps.names.len(), 1, "the write before the failure stands");
        assert!(maps.maps.slots.is_empty() && maps.maps.frontends.is_empty(), "nothing named by an unwritten name");
        r.sync(&d, &mut maps).unwrap();
        let mut ids: Vec<u32> = maps.maps.names.keys().copied().collect();
        ids.sort();
        assert_eq!(ids, [1, 2, 3], "the IDs of the failed writes were given back, not leaked");
        for (vip, backend) in [("10.96.0.1", "10.0.0.1"), ("10.96.0.2", "10.0.0.2"), ("10.96.0.3", "10.0.0.3")] {
            assert_eq!(resolve(&maps.maps, vip), [backend]);
        }
    }

    #[test]
    fn writes_at_once_that_fail_leave_the_mirror_true_and_the_next_sync_whole() {
        let d = desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.2"]), ("c", "10.96.0.3", &["10.0.0.3"])]);
        for (names_ok, backends_ok) in [(Some(1), None), (None, Some(1))] {
            let mut maps = FailOnce { names_ok, backends_ok, at_once: true, ..Default::default() };
            let mut r = Reconciler::adopt(Contents::default());
            let e = r.sync(&d, &mut maps).unwrap_err();
            assert!(format!("{e:#}").contains("map full"), "{e:#}");
            assert_eq!(maps.maps.slots.len(), 3, "the slots were written beside the failure");
            assert!(maps.maps.frontends.is_empty(), "nothing exposed after a failed write");
            let held = r.held();
            assert_eq!((&held.slots, &held.backends), (&maps.maps.slots, &maps.maps.backends), "the mirror holds what the maps hold");
            assert_eq!(held.names.keys().collect::<BTreeSet<_>>(), maps.maps.names.keys().collect());
            let known = d.backends.keys().filter(|t| crate::capacity::Held::has_backend(&r, t)).count();
            assert_eq!(known, maps.maps.backends.len(), "an ID whose write failed is not kept");

            r.sync(&d, &mut maps).unwrap();
            for (vip, backend) in [("10.96.0.1", "10.0.0.1"), ("10.96.0.2", "10.0.0.2"), ("10.96.0.3", "10.0.0.3")] {
                assert_eq!(resolve(&maps.maps, vip), [backend]);
            }
            assert_eq!((maps.maps.slots.len(), maps.maps.backends.len(), maps.maps.names.len()), (3, 3, 3), "no leftovers");
        }
    }

    /// The same services with sessionAffinity ClientIP on every frontend.
    fn sticky(mut d: DesiredState) -> DesiredState {
        for f in d.frontends.values_mut() {
            f.affinity_timeout_s = 10_800;
        }
        d
    }

    /// A new connection as `lb::choose_backend` makes it: the client's
    /// affinity entry if its backend ID exists, else slot 0, remembered.
    fn connect(c: &mut Contents, vip: &str, client: &str) -> String {
        let fe = c.frontends[&frontend(vip)];
        let key = AffinityKey { service_id: fe.service_id, client: Addr::from(client.parse::<IpAddr>().unwrap()) };
        if let Some(stuck) = c.affinity.get(&key)
            && let Some(b) = c.backends.get(&stuck.backend_id)
        {
            return b.addr.to_string();
        }
        let id = c.slots[&SlotKey { service_id: fe.service_id, slot: 0 }];
        c.affinity.insert(key, AffinityEntry { backend_id: id, ..Default::default() });
        c.backends[&id].addr.to_string()
    }

    fn backend_id(c: &Contents, ip: &str) -> u32 {
        let addr = Addr::from(ip.parse::<IpAddr>().unwrap());
        *c.backends.iter().find(|(_, b)| b.addr == addr).unwrap().0
    }

    /// Contents that log each call, and fail the next `fail_purges` purges.
    #[derive(Default)]
    struct Recorder {
        maps: Contents,
        log: Vec<String>,
        fail_purges: usize,
    }

    impl MapWriter for Recorder {
        fn put_backend(&mut self, id: u32, b: &Backend) -> Result<()> {
            self.log.push(format!("put_backend {id}"));
            self.maps.put_backend(id, b)
        }
        fn del_backend(&mut self, id: u32) -> Result<()> {
            self.log.push(format!("del_backend {id}"));
            self.maps.del_backend(id)
        }
        fn put_slot(&mut self, k: &SlotKey, v: u32) -> Result<()> {
            self.maps.put_slot(k, v)
        }
        fn del_slot(&mut self, k: &SlotKey) -> Result<()> {
            self.maps.del_slot(k)
        }
        fn put_frontend(&mut self, k: &FrontendKey, e: &ServiceEntry) -> Result<()> {
            self.log.push(format!("put_frontend {} flags {}", e.service_id, e.flags));
            self.maps.put_frontend(k, e)
        }
        fn del_frontend(&mut self, k: &FrontendKey) -> Result<()> {
            self.log.push("del_frontend".into());
            self.maps.del_frontend(k)
        }
        fn put_name(&mut self, id: u32, n: &ServiceName) -> Result<()> {
            self.log.push(format!("put_name {id}"));
            self.maps.put_name(id, n)
        }
        fn del_name(&mut self, id: u32) -> Result<()> {
            self.log.push(format!("del_name {id}"));
            self.maps.del_name(id)
        }
        fn put_maglev(&mut self, id: u32, t: &MaglevTable) -> Result<()> {
            self.log.push(format!("put_maglev {id}"));
            self.maps.put_maglev(id, t)
        }
        fn del_maglev(&mut self, id: u32) -> Result<()> {
            self.log.push(format!("del_maglev {id}"));
            self.maps.del_maglev(id)
        }
        fn put_source_range(&mut self, id: u32, n: &IpNet) -> Result<()> {
            self.maps.put_source_range(id, n)
        }
        fn del_source_range(&mut self, id: u32, n: &IpNet) -> Result<()> {
            self.maps.del_source_range(id, n)
        }
        fn put_service_cidr(&mut self, n: &IpNet) -> Result<()> {
            self.maps.put_service_cidr(n)
        }
        fn del_service_cidr(&mut self, n: &IpNet) -> Result<()> {
            self.maps.del_service_cidr(n)
        }
        fn purge_affinity(&mut self, settle: bool, stale: &mut dyn FnMut(&AffinityKey, &AffinityEntry) -> bool) -> Result<usize> {
            if self.fail_purges > 0 {
                self.fail_purges -= 1;
                self.log.push("purge failed".into());
                anyhow::bail!("map AFFINITY: walk failed");
            }
            self.log.push(format!("purge settle={settle}"));
            self.maps.purge_affinity(settle, stale)
        }
    }

    #[test]
    fn free_ids_are_quarantined_until_reopened() {
        let mut ids = FreeIds::new([].into_iter());
        assert_eq!((ids.take(), ids.take(), ids.take()), (1, 2, 3));
        ids.release(1);
        ids.release(2);
        assert_eq!(ids.take(), 4, "a freed ID is not handed out before the purge");
        ids.reopen();
        assert_eq!((ids.take(), ids.take(), ids.take()), (1, 2, 5), "then the lowest free first again");
        // An ID whose first write failed was never seen: back at once.
        let id = ids.take();
        ids.give_back(id);
        assert_eq!(ids.take(), id);
    }

    /// The reviewer's case: a sticky client stays quiet while its only
    /// endpoint is replaced; another Service then gets a new endpoint,
    /// which takes the freed backend ID. The client's next connection must
    /// stay on its own Service.
    #[test]
    fn a_sticky_client_never_follows_a_reused_backend_id_to_another_service() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        let step = |a: &[&str], b: &[&str]| sticky(desired(&[("a", "10.96.0.1", a), ("b", "10.96.0.2", b)]));
        r.sync(&step(&["10.0.0.1"], &[]), &mut maps).unwrap();
        assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.1");
        let old = backend_id(&maps, "10.0.0.1");

        let stats = r.sync(&step(&["10.0.0.2"], &[]), &mut maps).unwrap();
        assert_eq!(stats.affinity_purged, 1);
        assert!(maps.affinity.is_empty(), "the entry naming the removed backend went with it: {:?}", maps.affinity);

        r.sync(&step(&["10.0.0.2"], &["10.0.0.3"]), &mut maps).unwrap();
        assert_eq!(backend_id(&maps, "10.0.0.3"), old, "IDs are still reused, lowest first");
        for _ in 0..3 {
            assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.2", "a's client stays on a's endpoints");
        }
    }

    #[test]
    fn a_reused_service_id_inherits_no_entries() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        // d keeps 10.0.0.1's backend ID alive after a goes.
        r.sync(&sticky(desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("d", "10.96.0.4", &["10.0.0.1"])])), &mut maps).unwrap();
        assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.1");
        let a_id = maps.frontends[&frontend("10.96.0.1")].service_id;

        r.sync(&sticky(desired(&[("d", "10.96.0.4", &["10.0.0.1"])])), &mut maps).unwrap();
        r.sync(&sticky(desired(&[("d", "10.96.0.4", &["10.0.0.1"]), ("c", "10.96.0.3", &["10.0.0.5"])])), &mut maps).unwrap();
        assert_eq!(maps.frontends[&frontend("10.96.0.3")].service_id, a_id, "c took a's freed service ID");
        assert_eq!(connect(&mut maps, "10.96.0.3", "10.244.0.2"), "10.0.0.5", "not a's old backend, still d's");
    }

    #[test]
    fn an_entry_lives_while_its_backend_is_in_its_own_service_set() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        let both = |a: &[&str]| sticky(desired(&[("a", "10.96.0.1", a), ("b", "10.96.0.2", &["10.0.0.1"])]));
        r.sync(&both(&["10.0.0.1", "10.0.0.2"]), &mut maps).unwrap();
        assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.1");
        assert_eq!(connect(&mut maps, "10.96.0.2", "10.244.0.2"), "10.0.0.1");

        // Other endpoints come and go, the sticky one moves slot: kept.
        r.sync(&both(&["10.0.0.3", "10.0.0.1"]), &mut maps).unwrap();
        assert_eq!(maps.affinity.len(), 2);
        assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.1");

        // 10.0.0.1 leaves a's set, its ID lives on in b's: only a's entry goes.
        let stats = r.sync(&both(&["10.0.0.3"]), &mut maps).unwrap();
        assert_eq!(stats.affinity_purged, 1);
        let b_id = maps.frontends[&frontend("10.96.0.2")].service_id;
        assert_eq!(maps.affinity.keys().map(|k| k.service_id).collect::<Vec<_>>(), [b_id]);
        assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.3");
        assert_eq!(connect(&mut maps, "10.96.0.2", "10.244.0.2"), "10.0.0.1");
    }

    #[test]
    fn incremental_syncs_purge_too() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        let d1 = sticky(desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &[])]));
        r.sync(&d1, &mut maps).unwrap();
        connect(&mut maps, "10.96.0.1", "10.244.0.2");
        let d2 = sticky(desired(&[("a", "10.96.0.1", &["10.0.0.2"]), ("b", "10.96.0.2", &[])]));
        let touched = Touched {
            sets: [set("a")].into_iter().collect(),
            backends: [(ip("10.0.0.1"), 8080, IPPROTO_TCP), (ip("10.0.0.2"), 8080, IPPROTO_TCP)].into_iter().collect(),
            frontends: [frontend("10.96.0.1")].into_iter().collect(),
            ..Default::default()
        };
        assert_eq!(r.sync_touched(&d2, &touched, &mut maps).unwrap().affinity_purged, 1);
        assert!(maps.affinity.is_empty());
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_failed_purge_keeps_freed_ids_out_of_use_until_one_succeeds() {
        let mut maps = Recorder::default();
        let mut r = Reconciler::adopt(Contents::default());
        let step = |a: &[&str], b: &[&str]| sticky(desired(&[("a", "10.96.0.1", a), ("b", "10.96.0.2", b)]));
        r.sync(&step(&["10.0.0.1"], &[]), &mut maps).unwrap();
        connect(&mut maps.maps, "10.96.0.1", "10.244.0.2");
        let old = backend_id(&maps.maps, "10.0.0.1");

        // The removal is written, its purge fails: the sync fails.
        maps.fail_purges = 1;
        assert!(r.sync(&step(&["10.0.0.2"], &[]), &mut maps).is_err());
        assert!(!maps.maps.backends.contains_key(&old));
        assert_eq!(maps.maps.affinity.len(), 1, "the stale entry is still there");

        // The next sync purges first, and fails before writing if it cannot.
        maps.fail_purges = 1;
        maps.log.clear();
        assert!(r.sync(&step(&["10.0.0.2"], &["10.0.0.3"]), &mut maps).is_err());
        assert_eq!(maps.log, ["purge failed"], "nothing written while the purge is due");

        maps.log.clear();
        r.sync(&step(&["10.0.0.2"], &["10.0.0.3"]), &mut maps).unwrap();
        assert_eq!(maps.log[0], "purge settle=true");
        assert!(maps.maps.affinity.is_empty());
        assert_eq!(backend_id(&maps.maps, "10.0.0.3"), old, "reused once the purge went through");
        assert_eq!(connect(&mut maps.maps, "10.96.0.1", "10.244.0.2"), "10.0.0.2");
    }

    /// An agent stopped between a removal and its purge (or an older build)
    /// leaves entries naming IDs the maps no longer hold: the restarted
    /// agent purges them before it hands out any ID.
    #[test]
    fn adopted_maps_are_purged_before_any_id_is_handed_out() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        r.sync(&sticky(desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.2"])])), &mut maps).unwrap();
        assert_eq!(connect(&mut maps, "10.96.0.1", "10.244.0.2"), "10.0.0.1");
        assert_eq!(connect(&mut maps, "10.96.0.2", "10.244.0.2"), "10.0.0.2");
        // The previous agent removed b, without purging.
        let b = maps.frontends[&frontend("10.96.0.2")];
        let b_backend = backend_id(&maps, "10.0.0.2");
        maps.del_frontend(&frontend("10.96.0.2")).unwrap();
        maps.del_slot(&SlotKey { service_id: b.service_id, slot: 0 }).unwrap();
        maps.del_name(b.service_id).unwrap();
        maps.del_backend(b_backend).unwrap();

        // Adopted as `Maps::read_contents` reads them (no affinity entries).
        let mut restarted = Reconciler::adopt(Contents { affinity: HashMap::new(), ..maps.clone() });
        let mut rec = Recorder { maps, ..Default::default() };
        let d = sticky(desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("e", "10.96.0.5", &["10.0.0.9"])]));
        let stats = restarted.sync(&d, &mut rec).unwrap();
        assert_eq!(rec.log[0], "purge settle=true", "{:?}", rec.log);
        assert_eq!(stats.affinity_purged, 1);
        let e = rec.maps.frontends[&frontend("10.96.0.5")];
        assert_eq!((e.service_id, backend_id(&rec.maps, "10.0.0.9")), (b.service_id, b_backend), "b's IDs, reused");
        assert_eq!(connect(&mut rec.maps, "10.96.0.5", "10.244.0.2"), "10.0.0.9");
        assert_eq!(connect(&mut rec.maps, "10.96.0.1", "10.244.0.2"), "10.0.0.1", "a's client kept its backend");
        assert_eq!(rec.maps.affinity.len(), 2);
    }

    #[test]
    fn purges_wait_for_running_programs_only_after_affinity_was_served() {
        let mut maps = Recorder::default();
        let mut r = Reconciler::adopt(Contents::default());
        let mut purges = |d: DesiredState| {
            maps.log.clear();
            r.sync(&d, &mut maps).unwrap();
            maps.log.iter().filter(|l| l.starts_with("purge")).cloned().collect::<Vec<_>>()
        };
        // Adopted maps: purged first, waiting (a previous agent may have served affinity).
        assert_eq!(purges(desired(&[("a", "10.96.0.1", &["10.0.0.1"])])), ["purge settle=true"]);
        assert_eq!(purges(desired(&[("a", "10.96.0.1", &["10.0.0.1"])])), Vec::<String>::new(), "nothing removed");
        assert_eq!(purges(desired(&[("a", "10.96.0.1", &["10.0.0.2"])])), ["purge settle=false"], "no affinity anywhere");
        assert_eq!(purges(sticky(desired(&[("a", "10.96.0.1", &["10.0.0.3"])]))), ["purge settle=true"]);
        assert_eq!(purges(desired(&[("a", "10.96.0.1", &["10.0.0.4"])])), ["purge settle=true"], "served until now");
        assert_eq!(purges(desired(&[("a", "10.96.0.1", &["10.0.0.5"])])), ["purge settle=false"]);
    }

    /// The same services balanced by Maglev.
    fn with_maglev(mut d: DesiredState) -> DesiredState {
        for f in d.frontends.values_mut() {
            f.flags |= SVC_MAGLEV;
        }
        d.maglev = d.backend_sets.keys().cloned().collect();
        d
    }

    /// The addresses a frontend's Maglev table holds, cell by cell (the first M).
    fn table_of(c: &Contents, vip: &str) -> Vec<String> {
        let fe = c.frontends[&frontend(vip)];
        c.maglev[&fe.service_id][..MaglevParams::default().size as usize].iter().map(|id| c.backends[id].addr.to_string()).collect()
    }

    /// What the table should hold, by the pure function of the identities.
    fn expected_table(backends: &[&str]) -> Vec<String> {
        let members: Vec<(BackendTuple, String)> =
            backends.iter().map(|b| ((b.parse().unwrap(), 8080, IPPROTO_TCP), b.to_string())).collect();
        MaglevParams::default().cells(&members)
    }

    #[test]
    fn a_maglev_table_follows_its_set_and_goes_with_it() {
        let mut maps = Recorder::default();
        let mut r = Reconciler::adopt(Contents::default());
        // Another service first, so the IDs differ from the backends' order.
        let step = |a: &[&str]| with_maglev(desired(&[("a", "10.96.0.1", a), ("b", "10.96.0.2", &["10.0.0.9", "10.0.0.3"])]));
        r.sync(&step(&["10.0.0.1", "10.0.0.2", "10.0.0.3"]), &mut maps).unwrap();
        assert_eq!(table_of(&maps.maps, "10.96.0.1"), expected_table(&["10.0.0.3", "10.0.0.1", "10.0.0.2"]));
        assert_eq!(table_of(&maps.maps, "10.96.0.2"), expected_table(&["10.0.0.3", "10.0.0.9"]));
        let a = maps.maps.frontends[&frontend("10.96.0.1")].service_id;
        // Written before the frontend that reads it.
        let table_at = maps.log.iter().position(|l| *l == format!("put_maglev {a}")).unwrap();
        let frontend_at = maps.log.iter().position(|l| l.starts_with(&format!("put_frontend {a} "))).unwrap();
        assert!(table_at < frontend_at, "{:?}", maps.log);

        // Unchanged: not written again. One backend fewer: rewritten whole, once.
        maps.log.clear();
        r.sync(&step(&["10.0.0.1", "10.0.0.2", "10.0.0.3"]), &mut maps).unwrap();
        assert!(maps.log.iter().all(|l| !l.starts_with("put_maglev")), "{:?}", maps.log);
        r.sync(&step(&["10.0.0.1", "10.0.0.3"]), &mut maps).unwrap();
        assert_eq!(maps.log.iter().filter(|l| l.starts_with("put_maglev")).collect::<Vec<_>>(), [&format!("put_maglev {a}")]);
        assert_eq!(table_of(&maps.maps, "10.96.0.1"), expected_table(&["10.0.0.1", "10.0.0.3"]));

        // No endpoints: the frontend first stops reading it, then it goes.
        maps.log.clear();
        r.sync(&step(&[]), &mut maps).unwrap();
        let frontend_at = maps.log.iter().position(|l| l.starts_with(&format!("put_frontend {a} "))).unwrap();
        let gone_at = maps.log.iter().position(|l| *l == format!("del_maglev {a}")).unwrap();
        assert!(frontend_at < gone_at, "{:?}", maps.log);
        assert_eq!(maps.maps.frontends[&frontend("10.96.0.1")].backend_count, 0);
        assert!(!maps.maps.maglev.contains_key(&a));

        // Random again, then gone: no table left behind.
        r.sync(&step(&["10.0.0.1"]), &mut maps).unwrap();
        assert!(maps.maps.maglev.contains_key(&a));
        r.sync(&desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.3"])]), &mut maps).unwrap();
        assert!(maps.maps.maglev.is_empty());
        assert_eq!(maps.maps.frontends[&frontend("10.96.0.1")].flags & SVC_MAGLEV, 0);
        r.sync(&with_maglev(desired(&[("b", "10.96.0.2", &["10.0.0.3"])])), &mut maps).unwrap();
        r.sync(&DesiredState::default(), &mut maps).unwrap();
        assert!(maps.maps.maglev.is_empty() && maps.maps.frontends.is_empty());
    }

    /// A restarted agent (maybe with another seed or size) cannot know what
    /// the tables it adopts were built from: it rewrites them at its first
    /// sync, and removes those of services gone meanwhile.
    #[test]
    fn adopted_tables_are_rewritten_or_removed() {
        let mut maps = Contents::default();
        let mut r = Reconciler::adopt(Contents::default());
        let both = with_maglev(desired(&[("a", "10.96.0.1", &["10.0.0.1"]), ("b", "10.96.0.2", &["10.0.0.2"])]));
        r.sync(&both, &mut maps).unwrap();
        let b = maps.frontends[&frontend("10.96.0.2")].service_id;

        // As `Maps::read_contents` reads them: which services have one.
        let adopted = Contents { maglev: maps.maglev.keys().map(|id| (*id, Vec::new())).collect(), ..maps.clone() };
        let seeded = MaglevParams::new(7, 251).unwrap();
        let mut restarted = Reconciler::adopt(adopted).with_maglev(seeded);
        let mut rec = Recorder { maps, ..Default::default() };
        restarted.sync(&with_maglev(desired(&[("a", "10.96.0.1", &["10.0.0.1"])])), &mut rec).unwrap();
        let a = rec.maps.frontends[&frontend("10.96.0.1")].service_id;
        assert!(rec.log.contains(&format!("put_maglev {a}")), "{:?}", rec.log);
        assert!(rec.log.contains(&format!("del_maglev {b}")), "{:?}", rec.log);
        assert_eq!(rec.maps.maglev.keys().collect::<Vec<_>>(), [&a]);
        let cells = &rec.maps.maglev[&a];
        assert_eq!(cells.len(), MAGLEV_TABLE_MAX as usize);
        assert!(cells.iter().all(|id| rec.maps.backends[id].addr.to_string() == "10.0.0.1"));
    }
}

