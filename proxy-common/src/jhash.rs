//! Bob Jenkins' lookup3 hash over 32-bit words (`hashword`, which Linux
//! calls `jhash2` and Cilium uses for Maglev): a few dozen adds, xors and
//! rotations, no table and no loop once the word count is a constant, so the
//! BPF programs and the agent compute the very same value.

/// lookup3's `mix`.
#[inline(always)]
pub fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

/// lookup3's `final`.
#[inline(always)]
pub fn finish(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(14));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(11));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(25));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(16));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(4));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(14));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(24));
}

/// lookup3's initial state for `words` words.
#[inline(always)]
pub const fn initial(words: u32, initval: u32) -> u32 {
    0xdead_beef_u32.wrapping_add(words << 2).wrapping_add(initval)
}

/// lookup3's `hashword(k, N, initval)`, Linux's `jhash2`.
#[inline(always)]
pub fn jhash_words<const N: usize>(k: &[u32; N], initval: u32) -> u32 {
    let mut a = initial(N as u32, initval);
    let (mut b, mut c) = (a, a);
    let mut i = 0;
    while N - i > 3 {
        a = a.wrapping_add(k[i]);
        b = b.wrapping_add(k[i + 1]);
        c = c.wrapping_add(k[i + 2]);
        mix(&mut a, &mut b, &mut c);
        i += 3;
    }
    match N - i {
        3 => {
            c = c.wrapping_add(k[i + 2]);
            b = b.wrapping_add(k[i + 1]);
            a = a.wrapping_add(k[i]);
        }
        2 => {
            b = b.wrapping_add(k[i + 1]);
            a = a.wrapping_add(k[i]);
        }
        1 => a = a.wrapping_add(k[i]),
        _ => return c,
    }
    finish(&mut a, &mut b, &mut c);
    c
}

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;
    use proptest::prelude::*;

    /// lookup3's `hashlittle` on bytes, written from the same `mix` and
    /// `final`, only to check `jhash_words` against the published values
    /// (which are for byte strings) and against each other.
    fn hashlittle(key: &[u8], initval: u32) -> u32 {
        let mut a = 0xdead_beef_u32.wrapping_add(key.len() as u32).wrapping_add(initval);
        let (mut b, mut c) = (a, a);
        let word = |bytes: &[u8]| {
            let mut w = [0u8; 4];
            w[..bytes.len()].copy_from_slice(bytes);
            u32::from_le_bytes(w)
        };
        let mut rest = key;
        while rest.len() > 12 {
            a = a.wrapping_add(word(&rest[0..4]));
            b = b.wrapping_add(word(&rest[4..8]));
            c = c.wrapping_add(word(&rest[8..12]));
            mix(&mut a, &mut b, &mut c);
            rest = &rest[12..];
        }
        if rest.is_empty() {
            return c;
        }
        let part = |r: core::ops::Range<usize>| word(&rest[r.start.min(rest.len())..r.end.min(rest.len())]);
        a = a.wrapping_add(part(0..4));
        b = b.wrapping_add(part(4..8));
        c = c.wrapping_add(part(8..12));
        finish(&mut a, &mut b, &mut c);
        c
    }

    #[test]
    fn lookup3s_published_values() {
        // lookup3.c's driver5.
        assert_eq!(hashlittle(b"", 0), 0xdeadbeef);
        assert_eq!(hashlittle(b"", 0xdeadbeef), 0xbd5b7dde);
        assert_eq!(hashlittle(b"Four score and seven years ago", 0), 0x17770551);
        assert_eq!(hashlittle(b"Four score and seven years ago", 1), 0xcd628161);
        assert_eq!(jhash_words(&[], 0), 0xdeadbeef);
        assert_eq!(jhash_words(&[], 0xdeadbeef), 0xbd5b7dde);
    }

    fn bytes<const N: usize>(k: &[u32; N]) -> [u8; 64] {
        let mut out = [0u8; 64];
        for (i, w) in k.iter().enumerate() {
            out[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    proptest! {
        /// hashword is hashlittle on the words' little-endian bytes (as
        /// lookup3 says of aligned keys on a little-endian machine).
        #[test]
        fn words_hash_as_their_bytes(k in any::<[u32; 10]>(), k5 in any::<[u32; 5]>(), k3 in any::<[u32; 3]>(), init in any::<u32>()) {
            prop_assert_eq!(jhash_words(&k, init), hashlittle(&bytes(&k)[..40], init));
            prop_assert_eq!(jhash_words(&k5, init), hashlittle(&bytes(&k5)[..20], init));
            prop_assert_eq!(jhash_words(&k3, init), hashlittle(&bytes(&k3)[..12], init));
        }
    }
}
