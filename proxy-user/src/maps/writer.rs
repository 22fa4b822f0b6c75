//! Writing the service maps: the `MapWriter` the reconciler drives, for the
//! pinned maps (`Maps`) and for an in-memory stand-in (`Contents`, what the
//! maps hold, which the tests and the reconciler's own mirror use), and the
//! errors a write names its map with.

use std::collections::{BTreeSet, HashMap, HashSet};

use anyhow::Result;
use aya::maps::{MapError, lpm_trie::Key};
use ipnet::IpNet;
use proxy_common::*;

use super::{Maps, batch, lpm_prefix};
use crate::capacity::{Entries, ServiceMap};

/// What the maps hold (or, for the reconciler, what it has written).
#[derive(Clone, Default, Debug, PartialEq, Eq)]
pub struct Contents {
    pub frontends: HashMap<FrontendKey, ServiceEntry>,
    pub slots: HashMap<SlotKey, u32>,
    pub backends: HashMap<u32, Backend>,
    /// service ID -> (`namespace/name:port`, endpoint policy)
    pub names: HashMap<u32, (String, u8)>,
    /// loadBalancerSourceRanges entries: (service ID, allowed prefix).
    pub source_ranges: HashSet<(u32, IpNet)>,
    /// Where an address no Service owns is dropped.
    pub service_cidrs: BTreeSet<IpNet>,
    /// sessionAffinity entries. The datapath writes them; the agent only
    /// deletes stale ones (`MapWriter::purge_affinity`), never reads them
    /// into `Reconciler::held`: here for tests that stand in for the maps.
    pub affinity: HashMap<AffinityKey, AffinityEntry>,
    /// Maglev tables by service ID: their cells as written (the tests'
    /// stand-in), or none where read back from the pinned maps
    /// (`Maps::read_contents` reads which services have one, not the 64 KiB
    /// tables). The reconciler's mirror keeps what it built them from instead.
    pub maglev: HashMap<u32, Vec<u32>>,
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
    /// Replaces a service's whole Maglev table in one update: a packet
    /// reads either the old table or the new one.
    fn put_maglev(&mut self, service_id: u32, table: &MaglevTable) -> Result<()>;
    fn del_maglev(&mut self, service_id: u32) -> Result<()>;
    fn put_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()>;
    fn del_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()>;
    fn put_service_cidr(&mut self, net: &IpNet) -> Result<()>;
    fn del_service_cidr(&mut self, net: &IpNet) -> Result<()>;
    /// Deletes every AFFINITY entry `stale` picks and returns how many went.
    /// With `settle`, first waits until every BPF program running now has
    /// finished: one that read the maps before the removals just made could
    /// otherwise still write an entry naming a removed backend after the
    /// scan went past it.
    fn purge_affinity(&mut self, settle: bool, stale: &mut dyn FnMut(&AffinityKey, &AffinityEntry) -> bool) -> Result<usize>;

    // Many writes to one map, in order: how many were written, and the
    // error that stopped the rest. The maps do them in few kernel calls.
    fn put_backends(&mut self, entries: &[(u32, Backend)]) -> (usize, Result<()>) {
        each(entries, |(id, backend)| self.put_backend(*id, backend))
    }
    fn put_slots(&mut self, entries: &[(SlotKey, u32)]) -> (usize, Result<()>) {
        each(entries, |(key, backend_id)| self.put_slot(key, *backend_id))
    }
    fn put_frontends(&mut self, entries: &[(FrontendKey, ServiceEntry)]) -> (usize, Result<()>) {
        each(entries, |(key, entry)| self.put_frontend(key, entry))
    }
    fn put_names(&mut self, entries: &[(u32, ServiceName)]) -> (usize, Result<()>) {
        each(entries, |(id, name)| self.put_name(*id, name))
    }

    /// Backends, names and slots for maps that hold no frontend: no packet
    /// can reach a slot before a frontend names it (and names are read only
    /// by `dump`), so their order does not matter and a writer may write
    /// the three maps at once. Each map's (written, error) as in
    /// `put_backends`; a map's writes may stand after another map failed.
    fn put_unexposed(&mut self, backends: &[(u32, Backend)], names: &[(u32, ServiceName)], slots: &[(SlotKey, u32)]) -> [(usize, Result<()>); 3] {
        in_order(self, backends, names, slots)
    }
}

/// Backends, then names, then slots, each only if the one before it was
/// written whole: slots never name an unwritten backend or service.
pub fn in_order(
    maps: &mut (impl MapWriter + ?Sized),
    backends: &[(u32, Backend)],
    names: &[(u32, ServiceName)],
    slots: &[(SlotKey, u32)],
) -> [(usize, Result<()>); 3] {
    let backends = maps.put_backends(backends);
    if backends.1.is_err() {
        return [backends, (0, Ok(())), (0, Ok(()))];
    }
    let names = maps.put_names(names);
    if names.1.is_err() {
        return [backends, names, (0, Ok(()))];
    }
    [backends, names, maps.put_slots(slots)]
}

/// `write` on each entry until one fails: how many succeeded, and the error.
fn each<T>(entries: &[T], mut write: impl FnMut(&T) -> Result<()>) -> (usize, Result<()>) {
    for (done, entry) in entries.iter().enumerate() {
        if let Err(e) = write(entry) {
            return (done, Err(e));
        }
    }
    (entries.len(), Ok(()))
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
    fn put_maglev(&mut self, service_id: u32, table: &MaglevTable) -> Result<()> {
        self.maglev.insert(service_id, table.cells.to_vec());
        Ok(())
    }
    fn del_maglev(&mut self, service_id: u32) -> Result<()> {
        self.maglev.remove(&service_id);
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
    fn put_service_cidr(&mut self, net: &IpNet) -> Result<()> {
        self.service_cidrs.insert(*net);
        Ok(())
    }
    fn del_service_cidr(&mut self, net: &IpNet) -> Result<()> {
        self.service_cidrs.remove(net);
        Ok(())
    }
    fn purge_affinity(&mut self, _settle: bool, stale: &mut dyn FnMut(&AffinityKey, &AffinityEntry) -> bool) -> Result<usize> {
        let before = self.affinity.len();
        self.affinity.retain(|k, v| !stale(k, v));
        Ok(before - self.affinity.len())
    }
}

/// Fewer writes than this on either side are not worth a thread.
const THREAD_WORTH: usize = 4096;

impl MapWriter for Maps {
    fn put_backends(&mut self, entries: &[(u32, Backend)]) -> (usize, Result<()>) {
        let (done, result) = batch::insert_all(&mut self.backends, entries);
        (done, in_service_map(ServiceMap::Backends, self.service_capacity, result))
    }
    fn put_slots(&mut self, entries: &[(SlotKey, u32)]) -> (usize, Result<()>) {
        let (done, result) = batch::insert_all(&mut self.slots, entries);
        (done, in_service_map(ServiceMap::Slots, self.service_capacity, result))
    }
    fn put_frontends(&mut self, entries: &[(FrontendKey, ServiceEntry)]) -> (usize, Result<()>) {
        let (done, result) = batch::insert_all(&mut self.frontends, entries);
        (done, in_service_map(ServiceMap::Frontends, self.service_capacity, result))
    }
    fn put_names(&mut self, entries: &[(u32, ServiceName)]) -> (usize, Result<()>) {
        let (done, result) = batch::insert_all(&mut self.names, entries);
        (done, in_service_map(ServiceMap::Names, self.service_capacity, result))
    }
    /// Backends on a thread of their own, beside names then slots: the
    /// first sync of an empty node writes ~100,000 of each, and each
    /// insert is a kernel allocation, so two CPUs halve the wait.
    fn put_unexposed(&mut self, backends: &[(u32, Backend)], names: &[(u32, ServiceName)], slots: &[(SlotKey, u32)]) -> [(usize, Result<()>); 3] {
        if backends.len().min(names.len() + slots.len()) < THREAD_WORTH {
            return in_order(self, backends, names, slots);
        }
        let capacity = self.service_capacity;
        let (backends_map, names_map, slots_map) = (&mut self.backends, &mut self.names, &mut self.slots);
        let (backends_done, names_done, slots_done) = std::thread::scope(|scope| {
            let beside = scope.spawn(|| batch::insert_all(backends_map, backends));
            let names_done = batch::insert_all(names_map, names);
            let slots_done = batch::insert_all(slots_map, slots);
            (beside.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)), names_done, slots_done)
        });
        [
            (backends_done.0, in_service_map(ServiceMap::Backends, capacity, backends_done.1)),
            (names_done.0, in_service_map(ServiceMap::Names, capacity, names_done.1)),
            (slots_done.0, in_service_map(ServiceMap::Slots, capacity, slots_done.1)),
        ]
    }
    fn put_backend(&mut self, id: u32, backend: &Backend) -> Result<()> {
        in_service_map(ServiceMap::Backends, self.service_capacity, self.backends.insert(&id, backend, 0))
    }
    /// Removes the backend, then bumps the backends epoch: the datapath
    /// skips checking an established flow's backend while the epoch is the
    /// one its conntrack entry recorded, so the bump (after the removal) is
    /// what makes each flow of this backend move to a live one on its next
    /// packet. The reconciler reuses an ID only after removing it.
    fn del_backend(&mut self, id: u32) -> Result<()> {
        in_service_map(ServiceMap::Backends, self.service_capacity, self.backends.remove(&id))?;
        self.bump_backends_epoch()
    }
    fn put_slot(&mut self, key: &SlotKey, backend_id: u32) -> Result<()> {
        in_service_map(ServiceMap::Slots, self.service_capacity, self.slots.insert(key, &backend_id, 0))
    }
    fn del_slot(&mut self, key: &SlotKey) -> Result<()> {
        in_service_map(ServiceMap::Slots, self.service_capacity, self.slots.remove(key))
    }
    fn put_frontend(&mut self, key: &FrontendKey, entry: &ServiceEntry) -> Result<()> {
        in_service_map(ServiceMap::Frontends, self.service_capacity, self.frontends.insert(key, entry, 0))
    }
    fn del_frontend(&mut self, key: &FrontendKey) -> Result<()> {
        in_service_map(ServiceMap::Frontends, self.service_capacity, self.frontends.remove(key))
    }
    fn put_name(&mut self, id: u32, name: &ServiceName) -> Result<()> {
        in_service_map(ServiceMap::Names, self.service_capacity, self.names.insert(&id, name, 0))
    }
    fn del_name(&mut self, id: u32) -> Result<()> {
        in_service_map(ServiceMap::Names, self.service_capacity, self.names.remove(&id))
    }
    fn put_maglev(&mut self, service_id: u32, table: &MaglevTable) -> Result<()> {
        in_service_map(ServiceMap::Maglev, self.service_capacity, self.maglev.insert(&service_id, table, 0))
    }
    fn del_maglev(&mut self, service_id: u32) -> Result<()> {
        in_service_map(ServiceMap::Maglev, self.service_capacity, self.maglev.remove(&service_id))
    }
    fn put_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()> {
        let (len, addr) = lpm_prefix(net);
        let key = Key::new(32 + len, SourceRangeData { service_id, addr });
        in_service_map(ServiceMap::SourceRanges, self.service_capacity, self.source_ranges.insert(&key, &1, 0))
    }
    fn del_source_range(&mut self, service_id: u32, net: &IpNet) -> Result<()> {
        let (len, addr) = lpm_prefix(net);
        in_service_map(ServiceMap::SourceRanges, self.service_capacity, self.source_ranges.remove(&Key::new(32 + len, SourceRangeData { service_id, addr })))
    }
    fn put_service_cidr(&mut self, net: &IpNet) -> Result<()> {
        let (len, addr) = lpm_prefix(net);
        named(MAP_SERVICE_CIDRS, MAX_CIDRS, self.service_cidrs.insert(&Key::new(len, CidrData { addr }), &1, 0))
    }
    fn del_service_cidr(&mut self, net: &IpNet) -> Result<()> {
        let (len, addr) = lpm_prefix(net);
        named(MAP_SERVICE_CIDRS, MAX_CIDRS, self.service_cidrs.remove(&Key::new(len, CidrData { addr })))
    }
    /// Two passes: the stale keys first, then each deleted if still stale
    /// (the datapath may have rewritten it meanwhile; deleting while walking
    /// would restart the walk at every deleted key).
    fn purge_affinity(&mut self, settle: bool, stale: &mut dyn FnMut(&AffinityKey, &AffinityEntry) -> bool) -> Result<usize> {
        if settle {
            wait_for_running_programs();
        }
        let mut doomed = Vec::new();
        // A key that vanishes under the walk (LRU eviction) restarts it from
        // the first key: bounded, and an unfinished walk is an error (the
        // reconciler keeps the freed IDs out of use and tries again).
        let mut visited = 0u32;
        for kv in self.affinity.iter() {
            let (key, entry) = named(MAP_AFFINITY, MAX_AFFINITY, kv)?;
            visited += 1;
            anyhow::ensure!(visited <= 4 * MAX_AFFINITY, "map {MAP_AFFINITY}: the walk does not end (entries churning)");
            if stale(&key, &entry) {
                doomed.push(key);
            }
        }
        let mut purged = 0;
        for key in doomed {
            let entry = match self.affinity.get(&key, 0) {
                Ok(entry) => entry,
                Err(MapError::KeyNotFound) => continue,
                Err(e) => return named(MAP_AFFINITY, MAX_AFFINITY, Err(e)),
            };
            if !stale(&key, &entry) {
                continue;
            }
            match self.affinity.remove(&key) {
                Ok(()) => purged += 1,
                Err(MapError::SyscallError(aya::sys::SyscallError { io_error, .. })) if io_error.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return named(MAP_AFFINITY, MAX_AFFINITY, Err(e)),
            }
        }
        Ok(purged)
    }
}

/// Returns once every BPF program running when it was called has finished:
/// `membarrier(MEMBARRIER_CMD_GLOBAL)` waits for an RCU grace period
/// (`synchronize_rcu`), and the programs run inside RCU read-side sections,
/// as the kernel itself relies on when it waits for programs to stop using
/// a map. About 10 ms. Where it is refused (`nohz_full` kernels), a sleep
/// far longer than a program runs.
fn wait_for_running_programs() {
    const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;
    // SAFETY: membarrier takes two integers and touches no memory of ours.
    let done = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL, 0) } == 0;
    if !done {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A write the kernel refused because the map already holds `max_entries`
/// keys (an LPM trie says ENOSPC, a hash map E2BIG).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapFull {
    pub map: &'static str,
    pub capacity: u64,
}

impl std::fmt::Display for MapFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "map {} is full (capacity {} entries)", self.map, self.capacity)
    }
}

impl std::error::Error for MapFull {}

/// A map operation's error, naming the map (and, when the map was full,
/// as `MapFull`, which `full_map` finds again).
fn named<T>(map: &'static str, capacity: impl Into<u64>, result: Result<T, MapError>) -> Result<T> {
    result.map_err(|e| {
        let full = matches!(&e, MapError::SyscallError(aya::sys::SyscallError { io_error, .. })
            if matches!(io_error.raw_os_error(), Some(libc::ENOSPC | libc::E2BIG)));
        if full {
            anyhow::Error::new(e).context(MapFull { map, capacity: capacity.into() })
        } else {
            anyhow::Error::new(e).context(format!("map {map}"))
        }
    })
}

/// `named` for a service map, with the capacity it was created with.
fn in_service_map<T>(map: ServiceMap, capacity: Entries, result: Result<T, MapError>) -> Result<T> {
    named(map.name(), capacity[map as usize], result)
}

/// The map a failed write found full, if that is why it failed.
pub fn full_map(e: &anyhow::Error) -> Option<&MapFull> {
    e.downcast_ref::<MapFull>()
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    fn refused(errno: i32) -> Result<(), MapError> {
        Err(MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_update_elem",
            io_error: std::io::Error::from_raw_os_error(errno),
        }))
    }

    #[test]
    fn a_full_map_is_named_and_found_again_under_more_context() {
        for errno in [libc::ENOSPC, libc::E2BIG] {
            let e = named(MAP_SOURCE_RANGES, MAX_SOURCE_RANGES, refused(errno)).context("service ns/big: source range 10.0.0.0/24").unwrap_err();
            assert_eq!(full_map(&e), Some(&MapFull { map: MAP_SOURCE_RANGES, capacity: MAX_SOURCE_RANGES.into() }));
            let text = format!("{e:#}");
            assert!(text.starts_with("service ns/big: source range 10.0.0.0/24: map SOURCE_RANGES is full (capacity 65536 entries): "), "{text}");
        }
        let e = named(MAP_FRONTENDS, MAX_FRONTENDS, refused(libc::EPERM)).unwrap_err();
        assert_eq!(full_map(&e), None);
        assert!(format!("{e:#}").starts_with("map FRONTENDS: "), "{e:#}");
    }
}
