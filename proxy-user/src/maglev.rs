//! Maglev tables (Eisenbud et al., NSDI 2016, section 3.4): which backend
//! each of a Service's M cells names. A pure function of the backends'
//! identities (address, port, protocol), the cluster-wide seed and M, so
//! every node fed the same Services builds the same table; the cells are
//! then given this node's backend IDs. The datapath picks cell
//! `flow_hash % M` (`proxy_common::maglev`).

use anyhow::{Result, bail};
use proxy_common::{Addr, DEFAULT_MAGLEV_TABLE_SIZE, MAGLEV_TABLE_MAX, MaglevTable, maglev};

use crate::model::BackendTuple;

/// What every node must agree on: `--maglev-seed` and `--maglev-table-size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaglevParams {
    pub seed: u32,
    /// M, a prime no larger than MAGLEV_TABLE_MAX.
    pub size: u32,
}

impl Default for MaglevParams {
    fn default() -> Self {
        MaglevParams { seed: 0, size: DEFAULT_MAGLEV_TABLE_SIZE }
    }
}

impl MaglevParams {
    pub fn new(seed: u32, size: u32) -> Result<Self> {
        match check_size(size) {
            Ok(()) => Ok(MaglevParams { seed, size }),
            Err(why) => bail!("--maglev-table-size {size}: {why}"),
        }
    }

    /// The cells of a table for `backends` (any order; duplicates count
    /// once), each holding the `T` of its backend: `size` cells, empty
    /// without backends.
    pub fn cells<T: Clone>(&self, backends: &[(BackendTuple, T)]) -> Vec<T> {
        let mut members: Vec<&(BackendTuple, T)> = backends.iter().collect();
        // The canonical order the population takes turns in: by identity,
        // never by node-local IDs or map order.
        members.sort_by(|a, b| a.0.cmp(&b.0));
        members.dedup_by(|a, b| a.0 == b.0);
        populate(&members.iter().map(|m| m.0).collect::<Vec<_>>(), self.seed, self.size)
            .into_iter()
            .map(|i| members[i].1.clone())
            .collect()
    }

    /// `MAGLEV`'s value for `backends`, or None without backends. Cells past
    /// M repeat the table, so that a program loaded with another table size
    /// (an agent restarted with another `--maglev-table-size`, until its
    /// programs replace the old ones) still reads a live backend.
    pub fn table(&self, backends: &[(BackendTuple, u32)]) -> Option<Box<MaglevTable>> {
        let cells = self.cells(backends);
        if cells.is_empty() {
            return None;
        }
        let mut table = Box::new(MaglevTable { cells: [0; MAGLEV_TABLE_MAX as usize] });
        for (i, cell) in table.cells.iter_mut().enumerate() {
            *cell = cells[i % cells.len()];
        }
        Some(table)
    }
}

/// The population of section 3.4: each backend in turn takes the next cell
/// of its permutation still free, until every cell is taken. Returns, per
/// cell, the index of its backend in `backends`.
fn populate(backends: &[BackendTuple], seed: u32, size: u32) -> Vec<usize> {
    if backends.is_empty() {
        return Vec::new();
    }
    let permutations: Vec<(u64, u64)> = backends
        .iter()
        .map(|(ip, port, proto)| {
            let (offset, skip) = maglev::permutation(&Addr::from(*ip), port.to_be(), *proto, seed, size);
            (u64::from(offset), u64::from(skip))
        })
        .collect();
    let m = u64::from(size);
    let mut next = vec![0u64; backends.len()];
    let mut cells = vec![usize::MAX; size as usize];
    let mut filled = 0;
    loop {
        for (i, &(offset, skip)) in permutations.iter().enumerate() {
            // A prime size makes each permutation visit every cell, so a
            // free one is found while any is left.
            let mut cell = ((offset + next[i] * skip) % m) as usize;
            while cells[cell] != usize::MAX {
                next[i] += 1;
                cell = ((offset + next[i] * skip) % m) as usize;
            }
            cells[cell] = i;
            next[i] += 1;
            filled += 1;
            if filled == cells.len() {
                return cells;
            }
        }
    }
}

/// Why `size` cannot be M, if it cannot.
fn check_size(size: u32) -> Result<(), String> {
    if size > MAGLEV_TABLE_MAX {
        return Err(format!("larger than {MAGLEV_TABLE_MAX}, the most a table in the MAGLEV map holds"));
    }
    if !maglev::is_prime(size) {
        return Err("not a prime (Maglev needs a prime table size, e.g. 251, 1021, 4093, 16381)".into());
    }
    Ok(())
}

/// `--maglev-table-size`, checked as the command line is read.
pub fn parse_table_size(s: &str) -> Result<u32, String> {
    let size: u32 = s.trim().parse().map_err(|_| "not a number".to_string())?;
    check_size(size).map(|()| size)
}

/// `--maglev-seed`: decimal, or hexadecimal with `0x`.
pub fn parse_seed(s: &str) -> Result<u32, String> {
    let s = s.trim();
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|_| format!("{s:?}: not a 32-bit unsigned number (decimal, or hexadecimal with 0x)"))
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, net::IpAddr};

    use proptest::prelude::*;
    use proxy_common::{IPPROTO_TCP, IPPROTO_UDP};

    use super::*;

    fn tuple(i: u32) -> BackendTuple {
        (IpAddr::from([10, 1, (i >> 8) as u8, i as u8]), 8080, IPPROTO_TCP)
    }

    fn members(n: u32) -> Vec<(BackendTuple, BackendTuple)> {
        (0..n).map(|i| (tuple(i), tuple(i))).collect()
    }

    fn params(seed: u32) -> MaglevParams {
        MaglevParams::new(seed, DEFAULT_MAGLEV_TABLE_SIZE).unwrap()
    }

    /// Cells whose backend differs between two tables.
    fn changed(a: &[BackendTuple], b: &[BackendTuple]) -> usize {
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    }

    #[test]
    fn sizes_must_be_prime_and_fit_the_map() {
        assert_eq!(MaglevParams::new(1, 16_381).unwrap().size, 16_381);
        assert_eq!(MaglevParams::new(1, 251).unwrap().size, 251);
        let e = MaglevParams::new(0, 16_383).unwrap_err().to_string();
        assert!(e.contains("16383") && e.contains("larger than 16381"), "{e}");
        let e = MaglevParams::new(0, 1000).unwrap_err().to_string();
        assert!(e.contains("1000") && e.contains("not a prime"), "{e}");
        assert!(MaglevParams::new(0, 0).is_err() && MaglevParams::new(0, 1).is_err());
        assert_eq!(parse_table_size("4093"), Ok(4093));
        assert!(parse_table_size("4095").unwrap_err().contains("not a prime"));
        assert!(parse_table_size("65537").unwrap_err().contains("larger than 16381"));
    }

    #[test]
    fn seeds_are_decimal_or_hex() {
        assert_eq!(parse_seed("42"), Ok(42));
        assert_eq!(parse_seed("0xdeadBEEF"), Ok(0xdead_beef));
        assert_eq!(parse_seed(" 4294967295\n"), Ok(u32::MAX));
        assert!(parse_seed("4294967296").unwrap_err().contains("not a 32-bit"));
        assert!(parse_seed("secret").is_err());
    }

    #[test]
    fn no_backends_no_table() {
        assert!(params(0).cells::<u32>(&[]).is_empty());
        assert!(params(0).table(&[]).is_none());
    }

    #[test]
    fn the_whole_value_repeats_the_first_m_cells_with_node_ids() {
        let p = MaglevParams::new(3, 251).unwrap();
        let with_ids: Vec<(BackendTuple, u32)> = (0..5).map(|i| (tuple(i), 100 + i)).collect();
        let table = p.table(&with_ids).unwrap();
        let cells = p.cells(&with_ids);
        assert_eq!(cells.len(), 251);
        for (i, id) in table.cells.iter().enumerate() {
            assert_eq!(*id, cells[i % 251]);
        }
        let mut seen: Vec<u32> = cells.clone();
        seen.sort();
        seen.dedup();
        assert_eq!(seen, [100, 101, 102, 103, 104]);
    }

    #[test]
    fn one_backend_takes_every_cell() {
        let cells = params(0).cells(&members(1));
        assert_eq!(cells.len(), 16_381);
        assert!(cells.iter().all(|b| *b == tuple(0)));
    }

    #[test]
    fn more_backends_than_cells_fill_the_table() {
        let p = MaglevParams::new(0, 7).unwrap();
        let cells = p.cells(&members(10));
        assert_eq!(cells.len(), 7);
        let mut distinct = cells.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 7, "each takes one cell per turn: seven backends get one each");
    }

    /// The same seed and size, the same table: the population follows the
    /// backends' identities, whatever their order; another seed, another table.
    #[test]
    fn the_seed_decides_the_table() {
        let a = params(1).cells(&members(10));
        assert_ne!(a, params(2).cells(&members(10)));
        assert_eq!(a, params(1).cells(&members(10)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Every backend gets M/N cells, give or take one: the population
        /// hands out one cell per backend per turn.
        #[test]
        fn balanced(n in 1u32..200, seed in any::<u32>()) {
            let cells = params(seed).cells(&members(n));
            let mut counts: HashMap<BackendTuple, usize> = HashMap::new();
            for c in &cells {
                *counts.entry(*c).or_default() += 1;
            }
            prop_assert_eq!(counts.len(), n as usize);
            let (least, most) = (counts.values().min().unwrap(), counts.values().max().unwrap());
            prop_assert!(most - least <= 1, "{} backends: {}..={} cells each", n, least, most);
        }

        /// Deterministic for the same input in any order (and with
        /// duplicates), whatever the IDs each node gave the backends.
        #[test]
        fn deterministic_in_any_order(n in 1u32..60, seed in any::<u32>(), shuffle in any::<u64>(), id_base in any::<u16>()) {
            let sorted = members(n);
            let mut shuffled = sorted.clone();
            let mut rng = shuffle;
            for i in (1..shuffled.len()).rev() {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                shuffled.swap(i, (rng >> 33) as usize % (i + 1));
            }
            shuffled.extend(sorted.iter().take(3).copied());
            prop_assert_eq!(params(seed).cells(&sorted), params(seed).cells(&shuffled));
            // Node-local IDs only label the cells.
            let node_a: Vec<(BackendTuple, u32)> = sorted.iter().enumerate().map(|(i, (t, _))| (*t, i as u32 + 1)).collect();
            let node_b: Vec<(BackendTuple, u32)> = sorted.iter().enumerate().map(|(i, (t, _))| (*t, u32::from(id_base) + 7 * i as u32)).collect();
            let to_tuple = |table: Vec<u32>, ids: &[(BackendTuple, u32)]| -> Vec<BackendTuple> {
                let by_id: HashMap<u32, BackendTuple> = ids.iter().map(|(t, id)| (*id, *t)).collect();
                table.into_iter().map(|id| by_id[&id]).collect()
            };
            prop_assert_eq!(to_tuple(params(seed).cells(&node_a), &node_a), to_tuple(params(seed).cells(&node_b), &node_b));
        }

        /// The removed backend's cells all move to the others; adding it
        /// back gives the same table again.
        #[test]
        fn a_removed_backends_cells_move(n in 2u32..100, seed in any::<u32>(), which in any::<u32>()) {
            let p = params(seed);
            let before = p.cells(&members(n));
            let mut fewer = members(n);
            let gone = fewer.remove((which % n) as usize).0;
            let after = p.cells(&fewer);
            prop_assert!(before.iter().zip(&after).all(|(b, a)| *b != gone || a != b));
            prop_assert!(!after.contains(&gone));
            prop_assert_eq!(p.cells(&members(n)), before);
        }

        /// Adding or removing one backend changes 1/N of the cells (the
        /// backend's own share, N the backends after the change: the new one's
        /// share, or the removed one's spread over the N left) and a little
        /// more, never more than 1/N + 4% of M (measured worst: +3.1%, four
        /// backends; +2.1% with 163).
        #[test]
        fn one_backend_more_or_less_moves_little(n in 2u32..=163, seed in any::<u32>(), which in any::<u32>()) {
            let p = params(seed);
            let before = p.cells(&members(n));
            let mut fewer = members(n);
            fewer.remove((which % n) as usize);
            let after = p.cells(&fewer);
            let m = before.len() as f64;
            let share = changed(&before, &after) as f64 / m;
            prop_assert!(share <= 1.0 / f64::from(n - 1) + 0.04, "remove 1 of {}: {:.2}% of cells changed", n, share * 100.0);
            prop_assert!(share <= 1.0 / f64::from(n) + 0.04, "add 1 to {}: {:.2}% of cells changed", n - 1, share * 100.0);
        }
    }

    /// On average over seeds, one backend more or less changes at most 1/N
    /// + 1% of the cells while M/N is 400 or more (N up to 40 with M =
    /// 16381; the mean grows past 1% from about 50 backends: 1.3% at 100).
    /// Not for every seed: Maglev's population can cascade (up to 1/N +
    /// 3.1% measured), which `one_backend_more_or_less_moves_little` bounds.
    #[test]
    fn one_backend_more_or_less_moves_at_most_1_over_n_plus_1_percent_on_average() {
        const SEEDS: u32 = 12;
        for n in 2u32..=40 {
            let mut total = 0.0;
            for s in 0..SEEDS {
                let p = params(s.wrapping_mul(2_654_435_761));
                let before = p.cells(&members(n));
                let mut fewer = members(n);
                fewer.remove((s % n) as usize);
                total += changed(&before, &p.cells(&fewer)) as f64 / before.len() as f64;
            }
            // N after an addition (n) is the stricter of the two bounds.
            let mean = total / f64::from(SEEDS);
            assert!(mean <= 1.0 / f64::from(n) + 0.01, "{n} backends: {:.2}% of cells changed on average", mean * 100.0);
        }
    }

    #[test]
    fn protocols_and_ports_are_distinct_backends() {
        let ip = IpAddr::from([10, 0, 0, 1]);
        let b = [((ip, 53, IPPROTO_UDP), 1u32), ((ip, 53, IPPROTO_TCP), 2), ((ip, 5353, IPPROTO_UDP), 3)];
        let mut ids = params(0).cells(&b);
        ids.sort();
        ids.dedup();
        assert_eq!(ids, [1, 2, 3]);
    }
}

