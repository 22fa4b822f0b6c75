//! `tc_trace`'s report, written to its own unpinned map, which
//! `ebpf-proxy trace` (the process that loaded this instance) reads back.

use proxy_common::{Counter, TraceReport};

use crate::maps::TRACE_REPORT;

pub use proxy_common::TRACE_FROM_CONNTRACK as FROM_CONNTRACK;

#[inline(always)]
fn report() -> Option<*mut TraceReport> {
    TRACE_REPORT.get_ptr_mut(0)
}

/// The packet would have moved this counter.
#[inline(always)]
pub fn note(counter: Counter) {
    if let Some(r) = report() {
        unsafe { (*r).counters |= 1 << (counter as u32) };
    }
}

/// Which service and backend the packet reached, and how.
#[inline(always)]
pub fn record<const TRACE: bool>(service_id: u32, backend_id: u32, how: u32) {
    if TRACE && let Some(r) = report() {
        unsafe {
            (*r).service_id = service_id;
            (*r).backend_id = backend_id;
            (*r).how = how;
        }
    }
}

/// The Maglev cell a new flow's backend came from (TRACE_NO_MAGLEV_CELL:
/// none, the backend came from a random slot or the client's affinity).
#[inline(always)]
pub fn record_maglev_cell<const TRACE: bool>(cell: u32) {
    if TRACE && let Some(r) = report() {
        unsafe { (*r).maglev_cell = cell };
    }
}
