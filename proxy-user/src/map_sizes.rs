//! How many entries each sized BPF map gets.
//! - The conntrack tables: kube-proxy's rule (`--conntrack-max-per-core`
//!   times the CPUs, at least `--conntrack-min`) for the confirmed tables, a
//!   quarter of that for the unconfirmed ones. They are LRU hashes, which
//!   the kernel preallocates: the size is their memory.
//! - The service maps: `--service-map-entries` for FRONTENDS, BACKEND_SLOTS
//!   and BACKENDS, a share of it for SERVICE_NAMES and SOURCE_RANGES (the
//!   part Cilium's `--bpf-lb-map-max` plays). Their entries are allocated
//!   as they are written; the kernel allocates a hash map's buckets up front.
//!
//! The maps are pinned: a size is fixed when they are first created, and an
//! agent started with other flags keeps the pinned size (resizing would
//! forget every tracked connection) and says so.

use std::path::Path;

use anyhow::{Result, bail};
use proxy_common::{
    MAP_BACKEND_SLOTS, MAP_BACKENDS, MAP_CONNTRACK, MAP_CT_UNCONFIRMED, MAP_FRONTENDS, MAP_SERVICE_NAMES, MAP_SNAT,
    MAP_SNAT_UNCONFIRMED, MAP_SOURCE_RANGES, MAX_FRONTENDS, SERVICE_NAMES_SHARE, SOURCE_RANGES_SHARE, UNCONFIRMED_SHARE,
};

/// kube-proxy's defaults.
pub const DEFAULT_MAX_PER_CORE: u32 = 32_768;
pub const DEFAULT_MIN: u32 = 131_072;
/// Bounds that keep a typo from asking the kernel for gigabytes (an entry
/// of the conntrack map costs about 200 bytes with the kernel's overhead).
const LEAST: u32 = 1024;
const MOST: u32 = 1 << 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConntrackSize {
    /// CONNTRACK and SNAT.
    pub confirmed: u32,
    /// CT_UNCONFIRMED and SNAT_UNCONFIRMED.
    pub unconfirmed: u32,
}

impl Default for ConntrackSize {
    fn default() -> Self {
        Self::from_flags(DEFAULT_MAX_PER_CORE, DEFAULT_MIN, 1).expect("the defaults are in bounds")
    }
}

impl ConntrackSize {
    /// `max_per_core` x `cpus`, at least `min`; `max_per_core` 0: `min`.
    pub fn from_flags(max_per_core: u32, min: u32, cpus: u32) -> Result<Self> {
        let confirmed = max_per_core.saturating_mul(cpus).max(min);
        if !(LEAST..=MOST).contains(&confirmed) {
            bail!(
                "--conntrack-max-per-core {max_per_core} x {cpus} CPUs, --conntrack-min {min}: {confirmed} conntrack \
                 entries, outside {LEAST}..={MOST}"
            );
        }
        Ok(Self { confirmed, unconfirmed: (confirmed / UNCONFIRMED_SHARE).max(LEAST / UNCONFIRMED_SHARE) })
    }

    /// Each sized map with the entries it gets.
    pub fn maps(&self) -> [(&'static str, u32); 4] {
        [
            (MAP_CONNTRACK, self.confirmed),
            (MAP_SNAT, self.confirmed),
            (MAP_CT_UNCONFIRMED, self.unconfirmed),
            (MAP_SNAT_UNCONFIRMED, self.unconfirmed),
        ]
    }
}

/// `--service-map-entries`'s default: what this build's object declares.
pub const DEFAULT_SERVICE_MAP_ENTRIES: u32 = MAX_FRONTENDS;
/// The least that still holds SOURCE_RANGES' share of a few entries.
const SERVICE_LEAST: u32 = 1024;

/// The service maps' size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceMapSize {
    /// FRONTENDS, BACKEND_SLOTS and BACKENDS.
    pub entries: u32,
}

impl Default for ServiceMapSize {
    fn default() -> Self {
        Self { entries: DEFAULT_SERVICE_MAP_ENTRIES }
    }
}

impl ServiceMapSize {
    pub fn from_flag(entries: u32) -> Result<Self> {
        if !(SERVICE_LEAST..=MOST).contains(&entries) {
            bail!("--service-map-entries {entries}: outside {SERVICE_LEAST}..={MOST}");
        }
        Ok(Self { entries })
    }

    /// Each sized map with the entries it gets.
    pub fn maps(&self) -> [(&'static str, u32); 5] {
        let n = self.entries;
        [
            (MAP_FRONTENDS, n),
            (MAP_BACKEND_SLOTS, n),
            (MAP_BACKENDS, n),
            (MAP_SERVICE_NAMES, n / SERVICE_NAMES_SHARE),
            (MAP_SOURCE_RANGES, n / SOURCE_RANGES_SHARE),
        ]
    }
}

/// Every map the flags size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MapSizes {
    pub conntrack: ConntrackSize,
    pub services: ServiceMapSize,
}

impl MapSizes {
    /// The sizes to load with under `root`: where a map is already pinned,
    /// its size (with a warning if the flags ask for another).
    pub fn adopt_pinned(&self, root: &Path) -> Vec<(&'static str, u32)> {
        self.conntrack
            .maps()
            .into_iter()
            .chain(self.services.maps())
            .map(|(name, wanted)| {
                let pinned = aya::maps::MapInfo::from_pin(root.join(name)).ok().map(|info| info.max_entries());
                match pinned {
                    Some(n) if n != wanted => {
                        tracing::warn!(
                            map = name,
                            pinned = n,
                            flags = wanted,
                            "keeping the pinned map's size; to resize, stop the agent, run `ebpf-proxy cleanup` and \
                             start it again (tracked connections are forgotten)"
                        );
                        (name, n)
                    }
                    _ => (name, wanted),
                }
            })
            .collect()
    }
}

/// The CPUs, as kube-proxy counts them for `--conntrack-max-per-core` (those
/// this process may run on).
pub fn cpus() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_rule() {
        // 2 CPUs: the minimum wins; 8: the per-core figure.
        assert_eq!(ConntrackSize::from_flags(32_768, 131_072, 2).unwrap().confirmed, 131_072);
        assert_eq!(ConntrackSize::from_flags(32_768, 131_072, 8).unwrap().confirmed, 262_144);
        let s = ConntrackSize::from_flags(0, 4096, 64).unwrap();
        assert_eq!((s.confirmed, s.unconfirmed), (4096, 1024));
        assert_eq!(ConntrackSize::default().confirmed, proxy_common::MAX_CONNTRACK);
        assert_eq!(ConntrackSize::default().unconfirmed, proxy_common::MAX_CT_UNCONFIRMED);
    }

    #[test]
    fn service_maps_default_to_what_the_object_declares() {
        let declared = [
            proxy_common::MAX_FRONTENDS,
            proxy_common::MAX_BACKEND_SLOTS,
            proxy_common::MAX_BACKENDS,
            proxy_common::MAX_SERVICE_NAMES,
            proxy_common::MAX_SOURCE_RANGES,
        ];
        assert_eq!(ServiceMapSize::default().maps().map(|(_, n)| n), declared);
        assert_eq!(ServiceMapSize::from_flag(65_536).unwrap().maps().map(|(_, n)| n), [65_536, 65_536, 65_536, 32_768, 4096]);
        assert!(ServiceMapSize::from_flag(100).is_err());
    }

    #[test]
    fn bounds() {
        assert!(ConntrackSize::from_flags(0, 10, 4).is_err());
        assert!(ConntrackSize::from_flags(u32::MAX, 0, 4).is_err());
        assert_eq!(ConntrackSize::from_flags(0, LEAST, 1).unwrap().unconfirmed, LEAST / UNCONFIRMED_SHARE);
    }
}
