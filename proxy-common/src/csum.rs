//! Incremental update of the Internet checksum (RFC 1071), for the fields
//! the datapath rewrites in place: the IPv4 header checksum after an
//! address change, and an L4 checksum after a port change once
//! `pseudo_update` has told that it is a full one. (The pseudo-header's
//! change to an L4 checksum goes through the kernel's helper, which knows
//! whether the packet holds a full or a partial checksum; the IPv4 header
//! checksum is always a full one.)

/// The checksum field after 4 bytes it covers changed from `old` to `new`,
/// by RFC 1624 eqn. 3, `HC' = ~(~HC + ~m + m')`, the kernel's
/// `csum_replace4`. Field and data as they are on the wire; a wrong
/// checksum stays exactly as wrong.
#[inline(always)]
pub fn replace4(field: [u8; 2], old: [u8; 4], new: [u8; 4]) -> [u8; 2] {
    let word = |b: [u8; 4], i: usize| u16::from_be_bytes([b[i], b[i + 1]]) as u32;
    let sum = !u16::from_be_bytes(field) as u32 + !word(old, 0) as u16 as u32 + !word(old, 2) as u16 as u32
        + word(new, 0)
        + word(new, 2);
    // Five 16-bit terms: two folds bring the carries back in (no loop, for BPF).
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    (!(sum as u16)).to_be_bytes()
}

/// `replace4` for a 2-byte field (a port): the kernel's `csum_replace2`.
#[inline(always)]
pub fn replace2(field: [u8; 2], old: [u8; 2], new: [u8; 2]) -> [u8; 2] {
    let sum = !u16::from_be_bytes(field) as u32 + !u16::from_be_bytes(old) as u32 + u16::from_be_bytes(new) as u32;
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = (sum & 0xffff) + (sum >> 16);
    (!(sum as u16)).to_be_bytes()
}

/// What the kernel's L4 checksum helper did to a checksum field for a
/// 4-byte pseudo-header change (an IPv4 address) from `old` to `new`,
/// judged by the field `before` and `after` the call.
///
/// A full checksum (CHECKSUM_NONE, _UNNECESSARY, _COMPLETE) holds the
/// complement of the sum, so the helper takes the change D out of it
/// (`replace4`: F - D in one's complement arithmetic, that is mod 0xffff);
/// a CHECKSUM_PARTIAL packet's field holds the pseudo-header sum itself,
/// which the helper adds D to (F + D). The two differ unless 2D = 0, that
/// is unless D = 0 (mod 0xffff): then, and for a field the helper left alone
/// (UDP's "no checksum"), the answer is `Unknown`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PseudoUpdate {
    Full,
    Partial,
    Unknown,
}

#[inline(always)]
pub fn pseudo_update(before: [u8; 2], after: [u8; 2], old: [u8; 4], new: [u8; 4]) -> PseudoUpdate {
    let word = |b: [u8; 4], i: usize| u16::from_be_bytes([b[i], b[i + 1]]) as u32;
    let change = fold(!word(old, 0) as u16 as u32 + !word(old, 2) as u16 as u32 + word(new, 0) + word(new, 2));
    // 0 and 0xffff are the same number (mod 0xffff).
    let class = |v: u16| if v == 0xffff { 0 } else { v };
    if class(change) == 0 {
        return PseudoUpdate::Unknown;
    }
    let after = class(u16::from_be_bytes(after));
    if after == class(u16::from_be_bytes(replace4(before, old, new))) {
        PseudoUpdate::Full
    } else if after == class(fold(u16::from_be_bytes(before) as u32 + change as u32)) {
        PseudoUpdate::Partial
    } else {
        PseudoUpdate::Unknown
    }
}

/// One's complement sum of 16-bit words, unfolded.
#[inline(always)]
pub fn sum(bytes: &[u8], init: u32) -> u32 {
    let mut s = init;
    let mut i = 0;
    while i + 1 < bytes.len() {
        s += u16::from_be_bytes([bytes[i], bytes[i + 1]]) as u32;
        i += 2;
    }
    s
}

/// A one's complement sum of 16-bit words folded to 16 bits. Two folds
/// take any u32 there (the first leaves at most 0x1fffe): a fixed count,
/// because a `while s > 0xffff` loop is an "infinite loop" to verifiers
/// before 6.3, which cannot bound it.
#[inline(always)]
pub fn fold(s: u32) -> u16 {
    let s = (s & 0xffff) + (s >> 16);
    let s = (s & 0xffff) + (s >> 16);
    s as u16
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::vec::Vec;

    use etherparse::Ipv4Header;
    use proptest::prelude::*;

    use super::*;

    fn header(src: [u8; 4], dst: [u8; 4], ttl: u8, id: u16, len: u16) -> Ipv4Header {
        let mut h = Ipv4Header::new(len, ttl, etherparse::IpNumber::TCP, src, dst).unwrap();
        h.identification = id;
        h.header_checksum = h.calc_header_checksum();
        h
    }

    proptest! {
        /// `sum` and `fold` checksum what etherparse does, for any even
        /// length the rejects sum (up to an ICMP error's 36 bytes, and more).
        #[test]
        fn sum_and_fold_checksum_like_etherparse(words in proptest::collection::vec(any::<[u8; 2]>(), 0..64)) {
            let bytes: Vec<u8> = words.concat();
            // etherparse sums native-endian words: its result's bytes are the checksum field's.
            let want = etherparse::checksum::Sum16BitWords::new().add_slice(&bytes).ones_complement().to_ne_bytes();
            prop_assert_eq!(!fold(sum(&bytes, 0)), u16::from_be_bytes(want));
        }

        /// Against the reference: the checksum etherparse computes from
        /// scratch over the header with the new destination.
        #[test]
        fn matches_a_full_recomputation(
            src: [u8; 4], dst: [u8; 4], new: [u8; 4], ttl: u8, id: u16, len in 0u16..65000,
        ) {
            let before = header(src, dst, ttl, id, len);
            let after = header(src, new, ttl, id, len);
            let updated = replace4(before.header_checksum.to_be_bytes(), dst, new);
            prop_assert_eq!(u16::from_be_bytes(updated), after.header_checksum);
        }

        /// A checksum that was off by some amount stays off by it.
        #[test]
        fn keeps_an_error(src: [u8; 4], dst: [u8; 4], new: [u8; 4], off in 1u16..0xfffe) {
            let before = header(src, dst, 64, 1, 60);
            let after = header(src, new, 64, 1, 60);
            let wrong = before.header_checksum.wrapping_add(off);
            let updated = u16::from_be_bytes(replace4(wrong.to_be_bytes(), dst, new));
            prop_assert_ne!(updated, after.header_checksum);
        }

        /// A port change, against etherparse's UDP checksum from scratch.
        #[test]
        fn replace2_matches_a_full_recomputation(
            src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, new: u16, payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let ip = header(src, dst, 64, 1, 60);
            let sum = |port| etherparse::UdpHeader::with_ipv4_checksum(sport, port, &ip, &payload).unwrap().checksum;
            let updated = replace2(sum(dport).to_be_bytes(), dport.to_be_bytes(), new.to_be_bytes());
            // 0 and 0xffff are the same one's complement number; UDP sends 0xffff for 0.
            let (got, want) = (u16::from_be_bytes(updated), sum(new));
            prop_assert!(got == want || (got == 0 && want == 0xffff), "{got:#x} vs {want:#x}");
        }

        /// Two folds equal folding until the carries are gone.
        #[test]
        fn fold_matches_the_loop(s: u32) {
            let mut r = s;
            while r > 0xffff {
                r = (r & 0xffff) + (r >> 16);
            }
            prop_assert_eq!(fold(s), r as u16);
        }
    }

    /// The kernel's inet_proto_csum_replace4 with `pseudohdr` set, as
    /// written there: csum_partial over {~from, to} (32-bit words, carries
    /// folded back in), then csum_fold, with or without the complements of
    /// a full checksum.
    fn kernel_pseudo_replace(field: [u8; 2], old: [u8; 4], new: [u8; 4], partial: bool) -> [u8; 2] {
        let add32 = |a: u32, b: u32| {
            let (s, carry) = a.overflowing_add(b);
            s + carry as u32
        };
        // Words as they lie in memory, read little-endian (x86).
        let (from, to) = (u32::from_le_bytes(old), u32::from_le_bytes(new));
        let unfold = |f: [u8; 2]| u16::from_le_bytes(f) as u32;
        let csum_fold = |s: u32| {
            let s = (s & 0xffff) + (s >> 16);
            let s = (s & 0xffff) + (s >> 16);
            !(s as u16)
        };
        let out = if partial {
            !csum_fold(add32(add32(unfold(field), !from), to))
        } else {
            csum_fold(add32(add32(!unfold(field), !from), to))
        };
        out.to_le_bytes()
    }

    proptest! {
        /// Whichever way the helper updated the field, `pseudo_update` says
        /// which, or that it cannot tell; it never says the other.
        #[test]
        fn pseudo_update_tells_full_from_partial(field: [u8; 2], old: [u8; 4], new: [u8; 4], partial: bool) {
            let after = kernel_pseudo_replace(field, old, new, partial);
            let got = pseudo_update(field, after, old, new);
            let (right, wrong) = if partial { (PseudoUpdate::Partial, PseudoUpdate::Full) } else { (PseudoUpdate::Full, PseudoUpdate::Partial) };
            prop_assert_ne!(got, wrong);
            // Unknown only where the change sums to zero.
            let change = fold(sum(&old.map(|b| !b), 0) + sum(&new, 0));
            if change != 0 && change != 0xffff {
                prop_assert_eq!(got, right);
            }
        }
    }

    #[test]
    fn pseudo_update_cases() {
        let (old, new) = ([10, 96, 0, 10], [10, 244, 1, 7]);
        let field = [0x12, 0x34];
        for partial in [false, true] {
            let after = kernel_pseudo_replace(field, old, new, partial);
            let want = if partial { PseudoUpdate::Partial } else { PseudoUpdate::Full };
            assert_eq!(pseudo_update(field, after, old, new), want);
        }
        // A field left alone (UDP without a checksum): not a guess.
        assert_eq!(pseudo_update([0, 0], [0, 0], old, new), PseudoUpdate::Unknown);
        // Words swapped: the sum does not change, and neither does the field.
        assert_eq!(pseudo_update(field, field, [1, 2, 3, 4], [3, 4, 1, 2]), PseudoUpdate::Unknown);
    }

    #[test]
    fn unchanged_data_leaves_the_field() {
        let h = header([10, 0, 0, 1], [10, 96, 0, 10], 64, 7, 40);
        let f = h.header_checksum.to_be_bytes();
        assert_eq!(replace4(f, [10, 96, 0, 10], [10, 96, 0, 10]), f);
    }
}
