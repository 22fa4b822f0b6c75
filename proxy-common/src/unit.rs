//! The BPF unit tests' setup and report (proxy-ebpf/src/unit, run by
//! tests/tests/bpf_unit.rs): what the host hands a unit test program
//! before a run, and what the program reports of its concern's call.
//! Only the unit test object uses them; the agent's programs never do.

use crate::{Backend, CtEntry, ServiceEntry};

/// `UNIT_SETUP`'s one slot, written by the host before a run.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct UnitSetup {
    /// The service of a new flow (conntrack::create), or the one to
    /// choose a backend for (lb::choose_backend).
    pub service: ServiceEntry,
    /// A new flow's backend (conntrack::create), or the address and port a
    /// NAT rewrite writes.
    pub backend: Backend,
    pub backend_id: u32,
    /// conntrack::create's CT_* flags (CT_MASQUERADE, CT_NODE).
    pub ct_flags: u8,
    /// The scope lb::lookup_frontend looks in; `UNIT_SCOPE_OF_SOURCE`: the
    /// one lb::scope_of gives the packet's source.
    pub scope: u8,
    /// lb::choose_backend's `remember_choice` (0: as a trace, no state).
    pub remember: u8,
    pub _pad: u8,
}

pub const UNIT_SCOPE_OF_SOURCE: u8 = 0xff;

/// `UnitReport::miss`: lb::lookup_frontend's `Miss`, or none.
pub const UNIT_MISS_NONE: u8 = 0;
pub const UNIT_MISS_NOT_OURS: u8 = 1;
pub const UNIT_MISS_REJECT: u8 = 2;
pub const UNIT_MISS_DROP_UNALLOCATED: u8 = 3;

/// `UNIT_REPORT`'s one slot: zeroed by the host before a run, filled by
/// the program with what its concern's call returned.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct UnitReport {
    /// 1 once the packet parsed and the call ran: a report left at 0 means
    /// the program never got to it.
    pub ran: u8,
    /// The call found something: a conntrack entry, a frontend, a backend.
    pub found: u8,
    /// Packet::may_open_flow: with no entry found, a packet that may not
    /// open one is out of state.
    pub may_open_flow: u8,
    /// conntrack::completes_handshake.
    pub completes_handshake: u8,
    /// lb::choose_backend: the backend came from the client's affinity.
    pub sticky: u8,
    /// lb::lookup_frontend's miss (`UNIT_MISS_*`).
    pub miss: u8,
    pub _pad: [u8; 2],
    /// A `Result`'s error (0: Ok).
    pub rc: i64,
    /// The conntrack entry found.
    pub entry: CtEntry,
    /// The frontend's service found.
    pub service: ServiceEntry,
    /// The backend chosen.
    pub backend: Backend,
    pub backend_id: u32,
    /// lb::choose_backend: the Maglev cell it read, or TRACE_NO_MAGLEV_CELL.
    pub maglev_cell: u32,
    pub _pad_end: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_hidden_padding() {
        // Both sides copy them byte for byte (aya's Pod): every byte is a field.
        assert_eq!(size_of::<UnitSetup>(), 16 + 20 + 4 + 4);
        assert_eq!(size_of::<UnitReport>(), 8 + 8 + 72 + 16 + 20 + 4 + 8);
    }
}
