//! Incremental update of the Internet checksum (RFC 1071), for the fields
//! the datapath rewrites in place: the IPv4 header checksum after an
//! address change. (L4 checksums go through the kernel's helpers, which
//! know whether the packet holds a full or a partial checksum; the IPv4
//! header checksum is always a full one.)

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

    #[test]
    fn unchanged_data_leaves_the_field() {
        let h = header([10, 0, 0, 1], [10, 96, 0, 10], 64, 7, 40);
        let f = h.header_checksum.to_be_bytes();
        assert_eq!(replace4(f, [10, 96, 0, 10], [10, 96, 0, 10]), f);
    }
}
