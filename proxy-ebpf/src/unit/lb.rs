//! Load balancing's steps, one program each: the frontend lookup (which
//! service, or which miss) and the backend choice for the setup's service
//! (the slots and backends maps or the Maglev table, the client's affinity).

use aya_ebpf::{macros::classifier, programs::TcContext};
use proxy_common::unit::{UNIT_MISS_DROP_UNALLOCATED, UNIT_MISS_NOT_OURS, UNIT_MISS_REJECT, UNIT_SCOPE_OF_SOURCE};

use super::{NOT_RUN, ran, start};
use crate::{
    family::{Family, V4, V6},
    lb::{self, Miss},
    skb,
};

/// The packet's frontend, in the setup's scope (or its source's, by the
/// cluster CIDRs): the service entry found, or the miss.
#[classifier]
pub fn unit_lb_frontend(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { frontend::<V6>(&ctx) } else { frontend::<V4>(&ctx) }
}

#[inline(always)]
fn frontend<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, setup, report)) = start::<F>(ctx) else { return NOT_RUN };
    let scope = if setup.scope == UNIT_SCOPE_OF_SOURCE { lb::scope_of(&pkt.tuple.src) } else { setup.scope };
    match lb::lookup_frontend(&pkt.tuple, scope) {
        Ok(service) => {
            report.found = 1;
            report.service = service;
        }
        Err(Miss::NotOurs) => report.miss = UNIT_MISS_NOT_OURS,
        Err(Miss::Reject) => report.miss = UNIT_MISS_REJECT,
        Err(Miss::DropUnallocated) => report.miss = UNIT_MISS_DROP_UNALLOCATED,
    }
    ran(report)
}

/// A backend of the setup's service for the packet's source (remembered
/// for affinity if the setup says so).
#[classifier]
pub fn unit_lb_choose(ctx: TcContext) -> i32 {
    if skb::is_ipv6(&ctx) { choose::<V6>(&ctx) } else { choose::<V4>(&ctx) }
}

#[inline(always)]
fn choose<F: Family>(ctx: &TcContext) -> i32 {
    let Some((pkt, setup, report)) = start::<F>(ctx) else { return NOT_RUN };
    let chosen = lb::choose_backend(&setup.service, &pkt.tuple, setup.remember != 0);
    if let Some(choice) = chosen {
        report.found = 1;
        report.backend_id = choice.backend_id;
        report.backend = choice.backend;
        report.sticky = choice.sticky as u8;
        report.maglev_cell = choice.maglev_cell;
    }
    ran(report)
}
