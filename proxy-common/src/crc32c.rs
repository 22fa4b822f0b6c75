//! CRC32c (Castagnoli) for SCTP, and its incremental update.
//!
//! SCTP's checksum covers the SCTP packet only (common header with the
//! checksum field zeroed, plus chunks), not the IP pseudo-header: NAT of
//! addresses leaves it alone, but rewriting a port must fix it. A BPF program
//! cannot re-read a whole packet, so we use that the CRC is affine over GF(2):
//! `crc(M ^ D) = crc(M) ^ crc0(D)` for equal lengths (`crc0`: zero init, no
//! xorout). With D zero except a few bytes `n` bytes before the end,
//! `crc0(D)` = crc0 of those bytes times `x^(8n) mod P`, which takes at most
//! 32 polynomial multiplications with the `X8N_POW2` table; a port update
//! (< 2^16 bytes from the end) takes one, with x^(8n) from the `X8N` table.
//! Every loop here has a fixed bound of at most 32 so the code can be ported
//! to BPF.
//!
//! Byte order: the checksum is handled as the CRC value itself, which SCTP
//! (RFC 4960 App. B, like iSCSI, RFC 3720 B.4) puts on the wire least
//! significant byte first: `stored = u32::from_le_bytes(hdr[8..12])`, write
//! back with `to_le_bytes()`. On a little-endian host (BPF on x86/arm64) a
//! plain u32 load of the field yields exactly this value.

/// Reflected Castagnoli polynomial. Bit 31 of a value is the coefficient of
/// x^0 and bit 0 that of x^31, so "times x" is a right shift.
const POLY: u32 = 0x82F6_3B78;

/// Advances the raw CRC register over one zero bit, i.e. multiplies by x.
const fn times_x(v: u32) -> u32 {
    (v >> 1) ^ (POLY & (v & 1).wrapping_neg())
}

/// Advances the raw CRC register over one zero byte: times x^8.
const fn times_x8(mut v: u32) -> u32 {
    let mut k = 0;
    while k < 8 {
        v = times_x(v);
        k += 1;
    }
    v
}

/// Byte table for the reference CRC, built at compile time.
const TABLE: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = times_x8(i as u32);
        i += 1;
    }
    t
};

/// Runs the raw register (no init/xorout applied) over `data`.
const fn update_raw(mut reg: u32, data: &[u8]) -> u32 {
    let mut i = 0;
    while i < data.len() {
        reg = (reg >> 8) ^ TABLE[((reg ^ data[i] as u32) & 0xff) as usize];
        i += 1;
    }
    reg
}

/// Reference CRC32c of `data` (init and xorout 0xFFFFFFFF).
pub const fn crc32c(data: &[u8]) -> u32 {
    !update_raw(!0, data)
}

/// `a * b mod P` in the reflected representation. Bit-serial, always exactly
/// 32 rounds and branch-free, so it is a bounded loop for the BPF verifier.
pub const fn gf2_mulmod(a: u32, mut b: u32) -> u32 {
    let mut p = 0;
    let mut i = 0;
    while i < 32 {
        // Bit 31 - i of `a` is the coefficient of x^i; b holds b * x^i here.
        p ^= b & ((a >> (31 - i)) & 1).wrapping_neg();
        b = times_x(b);
        i += 1;
    }
    p
}

/// `X8N_POW2[k] = x^(8 * 2^k) mod P`: the factor that advances a raw CRC over
/// 2^k zero bytes. Entry 0 is x^8 (bit 31 - 8); each next one is a square.
pub const X8N_POW2: [u32; 32] = {
    let mut t = [0u32; 32];
    t[0] = 1 << (31 - 8);
    let mut k = 1;
    while k < 32 {
        t[k] = gf2_mulmod(t[k - 1], t[k - 1]);
        k += 1;
    }
    t
};

/// Raw CRC register `crc0` advanced over `n` zero bytes: multiplies by
/// x^(8n) = product of `X8N_POW2[k]` over the set bits k of `n`.
/// Branch-free (every factor is multiplied, then kept or dropped by a mask),
/// so a verifier would walk one path instead of one per bit pattern.
pub fn shift_zeros(crc0: u32, n: u32) -> u32 {
    let mut c = crc0;
    let mut k = 0;
    while k < 32 {
        let keep = ((n >> k) & 1).wrapping_neg();
        c = (gf2_mulmod(c, X8N_POW2[k]) & keep) | (c & !keep);
        k += 1;
    }
    c
}

/// The largest byte count a port update multiplies over: a distance from
/// the end below 2^16 (an IP packet), plus the 4-byte window.
const X8N_LEN: usize = (1 << 16) + 4;

/// `X8N[n] = x^(8n) mod P` for every byte count a port update can ask for
/// (256 KiB, in the programs' .rodata): the update is one table load and one
/// multiplication. Built one byte at a time.
#[allow(long_running_const_eval)]
static X8N: [u32; X8N_LEN] = {
    let mut t = [0u32; X8N_LEN];
    t[0] = 1 << 31; // x^0
    let mut n = 1;
    while n < X8N_LEN {
        t[n] = times_x8(t[n - 1]);
        n += 1;
    }
    t
};

/// New checksum after the 4 bytes `old` at some position were replaced by
/// `new`, with `dist_from_end` bytes of covered data after them. `stored` is
/// the checksum as found in the packet (see the module doc for byte order).
/// Only the xor difference matters, so a bad checksum stays exactly as wrong
/// as it was: the update never turns a corrupt packet into a valid one.
pub fn update_for_change(stored: u32, old: [u8; 4], new: [u8; 4], dist_from_end: u32) -> u32 {
    // Bytes enter the register low byte first, so the 4-byte difference read
    // little-endian is the register after xoring it in; 32 clocks (x^32 =
    // X8N_POW2[2]) give crc0 of the difference, then shift over the tail.
    let d = u32::from_le_bytes(old) ^ u32::from_le_bytes(new);
    stored ^ shift_zeros(gf2_mulmod(d, X8N_POW2[2]), dist_from_end)
}

/// Same for a 2-byte change (one port). Leading zero difference bytes add
/// nothing to crc0, so the window is padded at the front with zeros and keeps
/// the same `dist_from_end`, even if the padding lies before the packet start.
pub fn update_for_change16(stored: u32, old: [u8; 2], new: [u8; 2], dist_from_end: u32) -> u32 {
    update_for_change(stored, [0, 0, old[0], old[1]], [0, 0, new[0], new[1]], dist_from_end)
}

/// `update_for_change16` for a distance that fits an IP packet (< 2^16
/// bytes): what the datapath calls for a port rewrite. The 4-byte window's
/// crc0 is d * x^32, shifted over the tail: d * x^(8m) with m = dist + 4,
/// one entry of `X8N`, so one multiplication (32 rounds of shift-and-xor).
#[inline(always)]
pub fn update_port(stored: u32, old: [u8; 2], new: [u8; 2], dist_from_end: u16) -> u32 {
    let d = u32::from_le_bytes([0, 0, old[0], old[1]]) ^ u32::from_le_bytes([0, 0, new[0], new[1]]);
    // Always in bounds (a u16 plus 4); the check is the BPF verifier's proof.
    let m = dist_from_end as usize + 4;
    if m >= X8N_LEN {
        return stored;
    }
    stored ^ gf2_mulmod(d, X8N[m])
}

/// Checksum of a whole SCTP packet (header + chunks) with its checksum field
/// (bytes 8..12) taken as zero, in the stored convention. Panics below 12 bytes.
pub fn sctp_checksum(packet: &[u8]) -> u32 {
    let reg = update_raw(!0, &packet[..8]);
    let reg = update_raw(reg, &[0; 4]);
    !update_raw(reg, &packet[12..])
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use proptest::prelude::*;
    use std::vec::Vec;

    /// The reference the tests trust: the crc32c crate over the packet with
    /// the checksum field zeroed.
    fn crate_sctp(p: &[u8]) -> u32 {
        let mut z = p.to_vec();
        z[8..12].fill(0);
        crc32c::crc32c(&z)
    }

    #[test]
    fn known_vectors_and_wire_order() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), crc32c::crc32c(b""));
        // RFC 3720 B.4 lists the CRC bytes in transmission order.
        let inc: Vec<u8> = (0..32).collect();
        let dec: Vec<u8> = (0..32).rev().collect();
        let cases: [(&[u8], [u8; 4]); 4] = [
            (&[0; 32], [0xaa, 0x36, 0x91, 0x8a]),
            (&[0xff; 32], [0x43, 0xab, 0xa8, 0x62]),
            (&inc, [0x4e, 0x79, 0xdd, 0x46]),
            (&dec, [0x5c, 0xdb, 0x3f, 0x11]),
        ];
        for (data, wire) in cases {
            assert_eq!(crc32c(data), crc32c::crc32c(data));
            assert_eq!(crc32c(data).to_le_bytes(), wire);
        }
    }

    #[test]
    fn real_sctp_init_packet() {
        // SCTP part of scapy's regression test "SCTP - Chunk Init - build"
        // (IP()/SCTP()/SCTPChunkInit(params=[IPv4Addr])); checksum 0x402c0b5f
        // as bytes 40 2c 0b 5f on the wire.
        let mut p = [0u8; 40];
        p[8..12].copy_from_slice(&[0x40, 0x2c, 0x0b, 0x5f]);
        p[12..16].copy_from_slice(&[0x01, 0x00, 0x00, 0x1c]);
        p[32..40].copy_from_slice(&[0x00, 0x05, 0x00, 0x08, 0x7f, 0x00, 0x00, 0x01]);
        let stored = u32::from_le_bytes(p[8..12].try_into().unwrap());
        assert_eq!(sctp_checksum(&p), stored);
        assert_eq!(crate_sctp(&p), stored);
        assert_ne!(u32::from_be_bytes(p[8..12].try_into().unwrap()), stored);
    }

    /// Packet with a correct checksum, plus a valid 4-byte change offset that
    /// avoids the checksum field (changes there are invisible to the CRC).
    fn packet() -> impl Strategy<Value = (Vec<u8>, usize)> {
        (prop::collection::vec(any::<u8>(), 12..2000), any::<prop::sample::Index>()).prop_map(
            |(mut p, ix)| {
                let c = crate_sctp(&p);
                p[8..12].copy_from_slice(&c.to_le_bytes());
                let off = ix.index(p.len() - 3);
                (p, if (5..12).contains(&off) { 0 } else { off })
            },
        )
    }

    /// Rewrites 4 bytes at `off` and the stored checksum, as the BPF side will.
    fn rewrite(p: &mut [u8], off: usize, new: [u8; 4]) {
        let old: [u8; 4] = p[off..off + 4].try_into().unwrap();
        let stored = u32::from_le_bytes(p[8..12].try_into().unwrap());
        let dist = (p.len() - off - 4) as u32;
        p[off..off + 4].copy_from_slice(&new);
        let upd = update_for_change(stored, old, new, dist);
        p[8..12].copy_from_slice(&upd.to_le_bytes());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5000))]

        #[test]
        fn matches_crate(data in prop::collection::vec(any::<u8>(), 0..3000)) {
            prop_assert_eq!(crc32c(&data), crc32c::crc32c(&data));
            if data.len() >= 12 {
                prop_assert_eq!(sctp_checksum(&data), crate_sctp(&data));
            }
        }

        #[test]
        fn change_anywhere((mut p, off) in packet(), new in any::<[u8; 4]>()) {
            rewrite(&mut p, off, new);
            prop_assert_eq!(u32::from_le_bytes(p[8..12].try_into().unwrap()), crate_sctp(&p));
        }

        #[test]
        fn change_ports(
            (mut p, _) in packet(), new in any::<[u8; 4]>(), sport in any::<[u8; 2]>(), dport in any::<[u8; 2]>()
        ) {
            rewrite(&mut p, 0, new);
            prop_assert_eq!(sctp_checksum(&p), crate_sctp(&p));
            // Source port alone, via the 2-byte helper (window starts before the packet).
            let stored = u32::from_le_bytes(p[8..12].try_into().unwrap());
            let old = [p[0], p[1]];
            p[..2].copy_from_slice(&sport);
            let upd = update_for_change16(stored, old, sport, (p.len() - 2) as u32);
            prop_assert_eq!(upd, crate_sctp(&p));
            // Destination port via the datapath's 16-bit-distance variant.
            let stored = upd;
            let old = [p[2], p[3]];
            p[2..4].copy_from_slice(&dport);
            let upd = update_port(stored, old, dport, (p.len() - 4) as u16);
            prop_assert_eq!(upd, crate_sctp(&p));
        }

        #[test]
        fn bad_checksum_stays_bad((mut p, off) in packet(), new in any::<[u8; 4]>(), err in 1..=u32::MAX) {
            let bad = u32::from_le_bytes(p[8..12].try_into().unwrap()) ^ err;
            p[8..12].copy_from_slice(&bad.to_le_bytes());
            rewrite(&mut p, off, new);
            // Exactly as wrong as before: the same error pattern, not a new one.
            prop_assert_eq!(u32::from_le_bytes(p[8..12].try_into().unwrap()), crate_sctp(&p) ^ err);
        }
    }

    proptest! {
        // Packets up to the IP maximum, for the 16-bit distance of the
        // datapath variant; fewer cases as each one is up to 64 KiB.
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn port_update_up_to_max_ip_packet(
            len in 12usize..=65_515, seed in any::<u64>(), sport in any::<[u8; 2]>(), dport in any::<[u8; 2]>()
        ) {
            use rand::{RngCore, SeedableRng};
            let mut p = std::vec![0u8; len];
            rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut p);
            let c = crate_sctp(&p);
            p[8..12].copy_from_slice(&c.to_le_bytes());
            for (at, port) in [(0, sport), (2, dport)] {
                let stored = u32::from_le_bytes(p[8..12].try_into().unwrap());
                let old = [p[at], p[at + 1]];
                p[at..at + 2].copy_from_slice(&port);
                let upd = update_port(stored, old, port, (len - at - 2) as u16);
                p[8..12].copy_from_slice(&upd.to_le_bytes());
            }
            prop_assert_eq!(u32::from_le_bytes(p[8..12].try_into().unwrap()), crate_sctp(&p));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5000))]

        #[test]
        fn table_matches_square_and_multiply(n in 0usize..X8N_LEN) {
            prop_assert_eq!(X8N[n], shift_zeros(1 << 31, n as u32));
        }

    }

    proptest! {
        // Fewer cases: the reference loop walks up to 100k bytes per case.
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn shift_zeros_matches_loop(c in any::<u32>(), n in 0u32..=100_000) {
            let mut reg = c;
            for _ in 0..n {
                reg = update_raw(reg, &[0]);
            }
            prop_assert_eq!(shift_zeros(c, n), reg);
        }
    }
}
