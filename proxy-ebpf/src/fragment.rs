//! IP fragments. Only a datagram's first fragment carries its ports, so the
//! ports are remembered by the datagram (addresses, protocol, IP ID) and its
//! later fragments take them: each then finds the flow its first found and
//! gets the same translation, as Cilium's fragment map does. A later
//! fragment has no L4 header, so only its addresses change (the L4
//! checksum, in the first, covers the whole datagram: its update there
//! stands for all).
//!
//! Fragments reach this only through the fragment programs
//! (`FRAGMENT_PROGRAMS`), which ingress and egress tail-call when their
//! parse meets one: packets that are not fragments pay nothing.

use proxy_common::{Addr, Counter, FragmentKey, FragmentPorts};

use crate::maps::{FRAGMENTS, count};

/// Where a packet stands in its datagram (`Packet::fragment`).
pub const NOT_FRAGMENT: u8 = 0;
pub const FIRST: u8 = 1;
pub const LATER: u8 = 2;

#[inline(always)]
pub fn key(src: Addr, dst: Addr, id: u32, proto: u8) -> FragmentKey {
    FragmentKey { src, dst, id, proto, _pad: [0; 3] }
}

/// A first fragment's ports, for the fragments that follow it.
#[inline(always)]
pub fn remember(key: &FragmentKey, sport: u16, dport: u16) {
    // Full (every slot a datagram in flight): the LRU drops the oldest,
    // whose fragments have most likely all passed.
    let _ = FRAGMENTS.insert(key, &FragmentPorts { sport, dport }, 0);
    count(Counter::FragmentFirst);
}

/// A later fragment's ports: its first's. None if the first was not seen
/// (it came later, went another way, or was forgotten): the caller passes
/// the fragment untouched and counts it (`Counter::Fragment`).
#[inline(always)]
pub fn ports_of(key: &FragmentKey) -> Option<FragmentPorts> {
    let ports = unsafe { FRAGMENTS.get(key) }.copied()?;
    count(Counter::FragmentFollowed);
    Some(ports)
}
