//! What every unit test program shares: the setup the host wrote, the
//! report the host reads back, and the packet, parsed by its family's
//! parser. A program returns `RAN` once its concern's call ran (its outcome
//! is in the report, the packet and the maps), `NOT_RUN` if it never got
//! there (the packet did not parse).

pub mod conntrack;
pub mod lb;
pub mod nat;
pub mod pktgen;
pub mod reject;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    macros::{map, xdp},
    maps::Array,
    programs::{TcContext, XdpContext},
};
use proxy_common::unit::{UnitReport, UnitSetup};

use crate::{family::Family, packet::Packet, parse};

#[map]
static UNIT_SETUP: Array<UnitSetup> = Array::with_max_entries(1, 0);

#[map]
static UNIT_REPORT: Array<UnitReport> = Array::with_max_entries(1, 0);

/// Not a unit test: passes every frame, for the conformance LAN's bridge
/// ports. A veth takes the frames its peer's native XDP sends (XDP_TX)
/// only while it runs native XDP itself.
#[xdp]
pub fn xdp_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

pub const RAN: i32 = TC_ACT_OK as i32;
pub const NOT_RUN: i32 = TC_ACT_SHOT as i32;

/// The run's packet (by `F`'s parser), setup and report; None if the
/// packet does not parse.
#[inline(always)]
pub fn start<F: Family>(ctx: &TcContext) -> Option<(Packet, &'static UnitSetup, &'static mut UnitReport)> {
    let pkt = parse::parse::<F>(ctx).ok()?;
    let setup = UNIT_SETUP.get(0)?;
    let report = unsafe { &mut *UNIT_REPORT.get_ptr_mut(0)? };
    Some((pkt, setup, report))
}

/// The call ran: says so in the report.
#[inline(always)]
pub fn ran(report: &mut UnitReport) -> i32 {
    report.ran = 1;
    RAN
}

/// A `Result`'s error for the report (0: Ok).
#[inline(always)]
pub fn rc<E: Into<i64>>(result: Result<(), E>) -> i64 {
    match result {
        Ok(()) => 0,
        Err(e) => e.into(),
    }
}
