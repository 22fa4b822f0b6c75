//! The IP family as a type. Every TC program is built for one family (the
//! IPv4 programs hand IPv6 frames to their IPv6 counterparts by tail call),
//! so the steps after the program's entry take it as a type parameter, `V4`
//! or `V6`: what differs between the families is chosen at compile time,
//! and each step is written once for both.

use crate::headers::{ETH_P_IP, ETH_P_IPV6, IPV4_DST_OFF, IPV4_SRC_OFF, IPV6_DST_OFF, IPV6_SRC_OFF};

pub trait Family {
    /// IPv6: the header has no checksum, and the headers are read with
    /// helpers rather than pulled into the linear data.
    const V6: bool;
    /// The Ethernet type of the family's packets.
    const ETHERTYPE: u16;
    /// Offsets of the source and destination addresses in the IP header.
    const SRC_OFF: usize;
    const DST_OFF: usize;
    /// The first of the address's 32-bit words in an `Addr`: an IPv4
    /// address is the last word of its IPv4-mapped form.
    const FIRST_WORD: usize;
}

pub struct V4;
pub struct V6;

impl Family for V4 {
    const V6: bool = false;
    const ETHERTYPE: u16 = ETH_P_IP;
    const SRC_OFF: usize = IPV4_SRC_OFF;
    const DST_OFF: usize = IPV4_DST_OFF;
    const FIRST_WORD: usize = 3;
}

impl Family for V6 {
    const V6: bool = true;
    const ETHERTYPE: u16 = ETH_P_IPV6;
    const SRC_OFF: usize = IPV6_SRC_OFF;
    const DST_OFF: usize = IPV6_DST_OFF;
    const FIRST_WORD: usize = 0;
}
