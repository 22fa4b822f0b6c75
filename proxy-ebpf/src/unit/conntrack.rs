//! Conntrack's operations, one program each, as the datapath calls them
//! (main.rs): `create` for a flow's opening, `lookup_flow` for every packet,
//! `touch` for a packet of a known flow, and the confirmation steps. The
//! host sequences them as a flow's packets would and checks the tables.

use aya_ebpf::{macros::classifier, programs::TcContext};

use super::{NOT_RUN, ran, rc, start};
use crate::{
    conntrack::{self, Confirming},
    family::{Family, V4, V6},
    headers::{TCP_ACK_OFF, TCP_SEQ_OFF},
    skb,
};
use proxy_common::CT_REPLY;

/// A new flow: both directions' entries for the packet's tuple, to the
/// setup's service and backend, with the setup's CT flags.
#[classifier]
pub fn unit_ct_create(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { create::<V6>(&ctx) } else { create::<V4>(&ctx) }
}

#[inline(always)]
fn create<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, setup, report)) = start::<F>(ctx) else { return NOT_RUN };
    let created = conntrack::create(&pkt.tuple, &setup.service, setup.backend_id, &setup.backend, setup.ct_flags, 0);
    report.rc = rc(created.map_err(i64::from));
    ran(report)
}

/// The live flow of the packet, in either direction (the entry is
/// reported), and whether the packet may open one: with no flow, a packet
/// that may not is out of state (main.rs drops it).
#[classifier]
pub fn unit_ct_lookup(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { lookup::<V6>(&ctx) } else { lookup::<V4>(&ctx) }
}

#[inline(always)]
fn lookup<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, _, report)) = start::<F>(ctx) else { return NOT_RUN };
    if let Some(entry) = conntrack::lookup_flow(&pkt) {
        report.found = 1;
        report.entry = *entry;
    }
    report.may_open_flow = pkt.may_open_flow() as u8;
    ran(report)
}

/// Another packet of a known flow: its entry touched (closing on a FIN or
/// RST).
#[classifier]
pub fn unit_ct_touch(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { touch::<V6>(&ctx) } else { touch::<V4>(&ctx) }
}

#[inline(always)]
fn touch<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, _, report)) = start::<F>(ctx) else { return NOT_RUN };
    if let Some(entry) = conntrack::lookup_mut(&pkt.tuple) {
        report.found = 1;
        conntrack::touch(entry, pkt.closes_connection());
    }
    ran(report)
}

/// The packet's flow confirmed (`Confirming::confirm`), from whichever of
/// its entries the packet finds: a reply's, or the original's (a TCP
/// client completing its handshake).
#[classifier]
pub fn unit_ct_confirm(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { confirm::<V6>(&ctx) } else { confirm::<V4>(&ctx) }
}

#[inline(always)]
fn confirm<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, _, report)) = start::<F>(ctx) else { return NOT_RUN };
    let Some(entry) = conntrack::lookup_mut(&pkt.tuple) else { return ran(report) };
    report.found = 1;
    let flow = if entry.direction == CT_REPLY {
        Confirming::of_reply(&pkt.tuple, entry)
    } else {
        Confirming::of_original(&pkt.tuple, entry)
    };
    if let Some(flow) = flow {
        flow.confirm();
    }
    ran(report)
}

/// The backend's SYN-ACK of an unconfirmed flow: the ACK that will
/// complete the handshake is recorded (`expect_handshake_ack`).
#[classifier]
pub fn unit_ct_syn_ack(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { syn_ack::<V6>(&ctx) } else { syn_ack::<V4>(&ctx) }
}

#[inline(always)]
fn syn_ack<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, _, report)) = start::<F>(ctx) else { return NOT_RUN };
    let Some(entry) = conntrack::lookup_mut(&pkt.tuple) else { return ran(report) };
    report.found = 1;
    let seq = ctx.load::<u32>(pkt.l4_off + TCP_SEQ_OFF);
    if let (Some(flow), Ok(seq)) = (Confirming::of_reply(&pkt.tuple, entry), seq) {
        flow.expect_handshake_ack(seq);
    }
    ran(report)
}

/// Whether the client's packet completes its flow's handshake
/// (`completes_handshake`): an ACK of the SYN-ACK recorded.
#[classifier]
pub fn unit_ct_handshake(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { handshake::<V6>(&ctx) } else { handshake::<V4>(&ctx) }
}

#[inline(always)]
fn handshake<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, _, report)) = start::<F>(ctx) else { return NOT_RUN };
    let Some(entry) = conntrack::lookup(&pkt.tuple) else { return ran(report) };
    report.found = 1;
    let acked = || ctx.load::<u32>(pkt.l4_off + TCP_ACK_OFF).ok();
    report.completes_handshake = conntrack::completes_handshake(entry, &pkt, acked) as u8;
    ran(report)
}
