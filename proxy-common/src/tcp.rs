//! TCP header layout, and the reset a REJECT answers a segment with.

/// The header without options.
pub const TCP_HLEN: usize = 20;
pub const TCP_SEQ_OFF: usize = 4;
pub const TCP_ACK_OFF: usize = 8;
pub const TCP_FLAGS_OFF: usize = 13;
pub const TCP_CSUM_OFF: usize = 16;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// RFC 793 reset for a segment that reached no listener, for either IP
/// family: `tcp` holds the segment's TCP header and becomes the reset's (no
/// options, checksum left zero); `l4_len` counts the segment's bytes after
/// the IP header. Seq from the segment's ACK if it had one, else 0 with an
/// ACK of everything it carried.
#[inline(always)]
pub fn reset_in_place(tcp: &mut [u8; TCP_HLEN], l4_len: u32) {
    // Scalars, not copies of the header: the stack is short.
    let word = |i: usize| u32::from_be_bytes([tcp[i], tcp[i + 1], tcp[i + 2], tcp[i + 3]]);
    let (ports, seq, ack) = (word(0), word(4), word(8));
    let doff = ((tcp[12] >> 4) as u32) * 4;
    let flags = tcp[13];
    let mut seg_len = l4_len.saturating_sub(doff);
    if flags & TCP_SYN != 0 {
        seg_len += 1;
    }
    if flags & TCP_FIN != 0 {
        seg_len += 1;
    }
    let (seq, ack, flags) =
        if flags & TCP_ACK != 0 { (ack, 0, TCP_RST) } else { (0, seq.wrapping_add(seg_len), TCP_RST | TCP_ACK) };
    tcp[0..4].copy_from_slice(&ports.rotate_left(16).to_be_bytes());
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&ack.to_be_bytes());
    tcp[12] = (TCP_HLEN as u8 / 4) << 4;
    tcp[13] = flags;
    tcp[14..].fill(0);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// RFC 793's reset for any segment: ports swapped, no options, no
        /// checksum yet; sequence from its ACK if it had one, else 0 and an
        /// ACK of every sequence number it took (data, SYN, FIN).
        #[test]
        fn a_reset_answers_any_segment_as_rfc_793_says(
            sport: u16, dport: u16, seq: u32, ack: u32, flags: u8, options in 0u32..=10, payload in 0u32..2000,
        ) {
            let doff = 5 + options;
            let mut tcp = [0u8; TCP_HLEN];
            tcp[0..2].copy_from_slice(&sport.to_be_bytes());
            tcp[2..4].copy_from_slice(&dport.to_be_bytes());
            tcp[4..8].copy_from_slice(&seq.to_be_bytes());
            tcp[8..12].copy_from_slice(&ack.to_be_bytes());
            tcp[12] = (doff as u8) << 4;
            tcp[13] = flags;
            tcp[14..].fill(0xab);
            reset_in_place(&mut tcp, doff * 4 + payload);

            let word = |i: usize| u32::from_be_bytes([tcp[i], tcp[i + 1], tcp[i + 2], tcp[i + 3]]);
            prop_assert_eq!(u16::from_be_bytes([tcp[0], tcp[1]]), dport);
            prop_assert_eq!(u16::from_be_bytes([tcp[2], tcp[3]]), sport);
            prop_assert_eq!(tcp[12], 5 << 4);
            prop_assert!(tcp[14..].iter().all(|b| *b == 0), "window, checksum and urgent pointer zero");
            if flags & TCP_ACK != 0 {
                prop_assert_eq!((word(4), word(8), tcp[13]), (ack, 0, TCP_RST));
            } else {
                let taken = payload + u32::from(flags & TCP_SYN != 0) + u32::from(flags & TCP_FIN != 0);
                prop_assert_eq!((word(4), word(8), tcp[13]), (0, seq.wrapping_add(taken), TCP_RST | TCP_ACK));
            }
        }
    }
}
