//! IP fragments of UDP datagrams (the fragmented traffic there is: large DNS
//! answers, UDP tunnels; TCP and SCTP size their packets to the path MTU
//! and send them unfragmented, so their rare fragments are passed untouched
//! and counted). Only a datagram's first fragment carries its ports, so the
//! ports are remembered by the datagram (addresses, protocol, IP ID) and its
//! later fragments take them: each then finds the flow its first found and
//! gets the same translation, as Cilium's fragment map does. A later
//! fragment has no L4 header, so only its addresses change (the L4
//! checksum, in the first, covers the whole datagram: its update there
//! stands for all).
//!
//! A first fragment is parsed and translated by ingress and egress
//! themselves, which remember its ports (`remember_first`); a later one
//! makes their parse fail, and they hand it by tail call to a small program
//! of its own (`FRAGMENT_PROGRAMS`) that takes the remembered ports and
//! follows the flow in conntrack, nothing more: packets that are not
//! fragments pay nothing, and the verifier little. The key is built in a
//! per-CPU slot, off the stack, which the programs are short of.

use proxy_common::{Addr, Counter, FragmentKey, FragmentPorts};

use crate::{
    context::PacketContext,
    family::Family,
    headers::{IPV6_HLEN, IPV6_SRC_OFF, IPV6_DST_OFF},
    maps::{FRAGMENT_KEY, FRAGMENTS, count},
    packet::Packet,
};

/// Where a packet stands in its datagram (`Packet::fragment`).
pub const NOT_FRAGMENT: u8 = 0;
pub const FIRST: u8 = 1;
pub const LATER: u8 = 2;

/// A datagram's key.
#[inline(always)]
pub fn key(src: &Addr, dst: &Addr, id: u32, proto: u8) -> Option<&'static FragmentKey> {
    let key = unsafe { &mut *FRAGMENT_KEY.get_ptr_mut(0)? };
    key.src = *src;
    key.dst = *dst;
    key.id = id;
    key.proto = proto;
    key._pad = [0; 3];
    Some(key)
}

/// An IPv6 datagram's key: its addresses read from the header at `l3_off`
/// straight into the slot.
#[inline(always)]
pub fn key_v6(ctx: &impl PacketContext, l3_off: usize, id: u32, proto: u8) -> Option<&'static FragmentKey> {
    let key = unsafe { &mut *FRAGMENT_KEY.get_ptr_mut(0)? };
    ctx.load_bytes(l3_off + IPV6_SRC_OFF, &mut key.src.0).ok()?;
    ctx.load_bytes(l3_off + IPV6_DST_OFF, &mut key.dst.0).ok()?;
    key.id = id;
    key.proto = proto;
    key._pad = [0; 3];
    Some(key)
}

/// A UDP datagram's first fragment (`Packet::fragment` FIRST, as `parse`
/// lets it through): its ports, for the fragments that follow.
/// Called by the programs that follow fragments (ingress, egress, IPv6
/// masquerade), not by `parse`, which every program inlines.
#[inline(always)]
pub fn remember_first<F: Family>(ctx: &impl PacketContext, pkt: &Packet) {
    let Some(id) = datagram_id::<F>(ctx, pkt.l3_off) else { return };
    if let Some(key) = key(&pkt.tuple.src, &pkt.tuple.dst, id, pkt.proto) {
        remember(key, pkt.tuple.sport, pkt.tuple.dport);
    }
}

/// The datagram's ID, of the IP header at `l3_off`: IPv4's own; IPv6's in
/// the Fragment header, right after the fixed one (`parse` takes no other).
#[inline(always)]
pub fn datagram_id<F: Family>(ctx: &impl PacketContext, l3_off: usize) -> Option<u32> {
    let id = if F::V6 {
        ctx.load::<u32>(l3_off + IPV6_HLEN + 4).map(u32::from_be)
    } else {
        ctx.load::<u16>(l3_off + 4).map(|id| u16::from_be(id) as u32)
    };
    id.ok()
}

#[inline(always)]
fn remember(key: &FragmentKey, sport: u16, dport: u16) {
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
