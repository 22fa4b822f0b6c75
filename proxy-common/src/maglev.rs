//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), the parts both
//! sides compute: a flow's hash (the datapath picks cell `hash % M` of its
//! Service's table) and each backend's place in the table's population
//! (offset and skip of its permutation). Both are lookup3 (`jhash`) keyed by
//! the cluster-wide seed, over bytes every node sees alike (addresses,
//! ports, protocol), never node-local IDs: the same Services, seed and table
//! size give every node the same table and the same backend for a 5-tuple.
//! The table itself is built by the agent (proxy-user's `maglev`).

use crate::{
    Addr, CtKey,
    jhash::{self, jhash_words},
};

/// One Service's table: `MAGLEV_TABLE_MAX` backend IDs, of which the
/// first M (`--maglev-table-size`) are used. A Maglev table's size must be
/// prime (every skip then visits every cell).
pub const MAP_MAGLEV: &str = "MAGLEV";
pub const MAGLEV_TABLE_MAX: u32 = 16_381;
pub const DEFAULT_MAGLEV_TABLE_SIZE: u32 = MAGLEV_TABLE_MAX;
/// Backend sets with a Maglev table (each 64 KiB, allocated as written).
pub const MAX_MAGLEV_TABLES: u32 = 4096;

/// Loader-set globals: the seed of every hash, and M.
pub const GLOBAL_MAGLEV_SEED: &str = "MAGLEV_SEED";
pub const GLOBAL_MAGLEV_TABLE_SIZE: &str = "MAGLEV_TABLE_SIZE";

/// Two u32 the agent writes at start, seed then M, for readers that load
/// no program of the agent's (`trace` loads its own copy of the object, with
/// these as its globals). The programs never read it.
pub const MAP_MAGLEV_SETTINGS: &str = "MAGLEV_SETTINGS";
pub const MAGLEV_SETTING_SEED: u32 = 0;
pub const MAGLEV_SETTING_TABLE_SIZE: u32 = 1;

/// `MAGLEV`'s value.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct MaglevTable {
    pub cells: [u32; MAGLEV_TABLE_MAX as usize],
}

fn addr_words(a: &Addr) -> [u32; 4] {
    [word(a, 0), word(a, 4), word(a, 8), word(a, 12)]
}

/// Bytes `i..i + 4` of an address as a big-endian word.
fn word(a: &Addr, i: usize) -> u32 {
    u32::from_be_bytes([a.0[i], a.0[i + 1], a.0[i + 2], a.0[i + 3]])
}

/// A flow's hash: `jhash_words` of source and destination address (four
/// big-endian words each), the ports (`sport` in the high half of one word,
/// `flow.dport` in the low; network order, as in packets) and the protocol.
/// `sport` is the flow's own, or 0 where it must not count (affinity).
/// Written out word by word, reading the addresses a word at a time: the
/// datapath calls it where the programs' stack is nearly full.
#[inline(always)]
pub fn flow_hash(flow: &CtKey, sport: u16, seed: u32) -> u32 {
    // CtKey is 4-aligned with its addresses at 0 and 16: eight aligned words.
    let words = flow as *const CtKey as *const u32;
    let w = |i: usize| u32::from_be(unsafe { words.add(i).read() });
    let ports = (u32::from(u16::from_be(sport)) << 16) | u32::from(u16::from_be(flow.dport));
    let mut a = jhash::initial(10, seed);
    let (mut b, mut c) = (a, a);
    a = a.wrapping_add(w(0));
    b = b.wrapping_add(w(1));
    c = c.wrapping_add(w(2));
    jhash::mix(&mut a, &mut b, &mut c);
    a = a.wrapping_add(w(3));
    b = b.wrapping_add(w(4));
    c = c.wrapping_add(w(5));
    jhash::mix(&mut a, &mut b, &mut c);
    a = a.wrapping_add(w(6));
    b = b.wrapping_add(w(7));
    c = c.wrapping_add(ports);
    jhash::mix(&mut a, &mut b, &mut c);
    a = a.wrapping_add(u32::from(flow.proto));
    jhash::finish(&mut a, &mut b, &mut c);
    c
}

/// The cell of a table of `size` cells a flow's hash picks.
#[inline(always)]
pub fn cell_of(hash: u32, size: u32) -> Option<u32> {
    hash.checked_rem(size)
}

/// A backend's permutation of a table of `size` (prime) cells: it prefers
/// cell `(offset + j * skip) % size` j-th. From its address, port (network
/// order) and protocol, hashed twice with the seed (and its complement).
pub fn permutation(addr: &Addr, port: u16, proto: u8, seed: u32, size: u32) -> (u32, u32) {
    let a = addr_words(addr);
    let key = [a[0], a[1], a[2], a[3], (u32::from(u16::from_be(port)) << 8) | u32::from(proto)];
    let offset = jhash_words(&key, seed) % size;
    let skip = if size > 1 { jhash_words(&key, !seed) % (size - 1) + 1 } else { 1 };
    (offset, skip)
}

/// Whether `n` is prime (trial division: table sizes are small).
pub const fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2;
    while d * d <= n {
        if n % d == 0 {
            return false;
        }
        d += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use core::net::IpAddr;
    use std::format;

    fn addr(s: &str) -> Addr {
        Addr::from(s.parse::<IpAddr>().unwrap())
    }

    #[test]
    fn the_largest_size_is_prime() {
        assert!(is_prime(MAGLEV_TABLE_MAX));
        assert!(is_prime(2) && is_prime(251) && is_prime(65_537));
        assert!(!is_prime(0) && !is_prime(1) && !is_prime(16_383) && !is_prime(65_536));
    }

    fn flow(src: &str, dst: &str, sport: u16, dport: u16, proto: u8) -> CtKey {
        CtKey { src: addr(src), dst: addr(dst), sport: sport.to_be(), dport: dport.to_be(), proto, _pad: [0; 3] }
    }

    #[test]
    fn the_flow_hash_is_jhash_of_the_tuple_words() {
        let f = flow("10.0.0.1", "10.96.0.10", 40000, 80, 6);
        let words = [0, 0, 0xffff, 0x0a00_0001, 0, 0, 0xffff, 0x0a60_000a, (40000 << 16) | 80, 6];
        assert_eq!(flow_hash(&f, f.sport, 7), jhash_words(&words, 7));
        let mut no_port = words;
        no_port[8] = 80;
        assert_eq!(flow_hash(&f, 0, 7), jhash_words(&no_port, 7));
        // A value pinned so that a change of the function shows: every node
        // (and every agent version during an upgrade) must agree on it.
        assert_eq!(flow_hash(&f, f.sport, 0), 0x202c_2b93);
        let v6 = flow("fd00::1", "fd00:96::a", 1, 2, 17);
        let words6 = [0xfd00_0000, 0, 0, 1, 0xfd00_0096, 0, 0, 0xa, (1 << 16) | 2, 17];
        assert_eq!(flow_hash(&v6, v6.sport, 3), jhash_words(&words6, 3));
    }

    #[test]
    fn every_field_and_the_seed_count() {
        let hash = |f: CtKey, seed| flow_hash(&f, f.sport, seed);
        let base = hash(flow("10.0.0.1", "10.96.0.10", 1000, 80, 6), 1);
        for other in [
            hash(flow("10.0.0.2", "10.96.0.10", 1000, 80, 6), 1),
            hash(flow("10.0.0.1", "10.96.0.11", 1000, 80, 6), 1),
            hash(flow("10.0.0.1", "10.96.0.10", 1001, 80, 6), 1),
            hash(flow("10.0.0.1", "10.96.0.10", 1000, 81, 6), 1),
            hash(flow("10.0.0.1", "10.96.0.10", 1000, 80, 17), 1),
            hash(flow("10.0.0.1", "10.96.0.10", 1000, 80, 6), 2),
            hash(flow("10.96.0.10", "10.0.0.1", 80, 1000, 6), 1),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn permutations_stay_in_the_table() {
        for size in [2, 3, 251, MAGLEV_TABLE_MAX] {
            for i in 0..50u8 {
                let (offset, skip) = permutation(&addr(&format!("10.0.0.{i}")), 8080u16.to_be(), 6, 9, size);
                assert!(offset < size && (1..size.max(2)).contains(&skip), "{size}: {offset} {skip}");
            }
        }
    }
}
