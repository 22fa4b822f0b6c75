//! The link-layer header in front of the IP header: Ethernet's 14 bytes on
//! most devices (and loopback's all-zero one), none on L3 devices
//! (WireGuard, IPIP, GRE, tun), whose packets start at the IP header.
//!
//! One object serves both: the agent loads it a second time, with
//! `L2_HLEN` set to 0, for the L3 devices it attaches to (as Cilium
//! compiles its programs per device). A read-only constant, so the
//! verifier knows every offset as it knew ETH_HLEN's, and drops the
//! branches of the other kind.

use aya_ebpf::{Global, programs::TcContext};

use crate::{context::PacketContext, headers::{ETH_HLEN, ETH_TYPE_OFF}};

/// Set by the agent at load: 0 in the copy of the object for L3 devices.
#[unsafe(no_mangle)]
static L2_HLEN: Global<u32> = Global::new(ETH_HLEN as u32);

/// Offset of the IP header in the packet.
#[inline(always)]
pub fn l3_off() -> usize {
    L2_HLEN.load() as usize
}

/// Whether packets carry an Ethernet header (the object for Ethernet
/// devices).
#[inline(always)]
pub fn has_ethernet() -> bool {
    L2_HLEN.load() != 0
}

/// The network protocol (host order): the Ethernet header's type, or on an
/// L3 device `skb->protocol`, which the device set from the packet.
#[inline(always)]
pub fn ethertype(ctx: &impl PacketContext) -> Option<u16> {
    if has_ethernet() {
        crate::context::read::<u16>(ctx, ETH_TYPE_OFF).map(u16::from_be)
    } else {
        Some(u16::from_be(ctx.protocol() as u16))
    }
}

/// Puts an Ethernet header (zero addresses, the packet's type) in front of
/// an L3 device's packet, to redirect it to an Ethernet device or into
/// loopback: bpf_redirect drops a packet without a MAC header there. The
/// caller writes the addresses. A no-op on Ethernet.
#[inline(always)]
pub fn push_ethernet(ctx: &TcContext) -> Result<(), i64> {
    if has_ethernet() {
        return Ok(());
    }
    let ethertype = ethertype(ctx).ok_or(-1i64)?;
    ctx.change_head(ETH_HLEN as u32, 0)?;
    ctx.store(0, &[0u8; ETH_TYPE_OFF], 0)?;
    ctx.store(ETH_TYPE_OFF, &ethertype.to_be_bytes(), 0)
}

/// Writes a frame built with an Ethernet header in front of `L3` bytes of
/// IP packet over the packet's start: whole on Ethernet, from the IP header
/// on an L3 device. The packet is already that long.
#[inline(always)]
pub fn store_frame<const L3: usize>(ctx: &impl PacketContext, frame: &[u8]) -> Result<(), i64> {
    let ip: &[u8; L3] = frame.get(ETH_HLEN..ETH_HLEN + L3).ok_or(-1i64)?.try_into().map_err(|_| -1i64)?;
    if has_ethernet() {
        let eth: &[u8; ETH_HLEN] = frame.get(..ETH_HLEN).ok_or(-1i64)?.try_into().map_err(|_| -1i64)?;
        ctx.store(0, eth, 0)?;
        ctx.store(ETH_HLEN, ip, 0)
    } else {
        ctx.store(0, ip, 0)
    }
}
