//! Map layouts. Names are the `#[map]` statics in proxy-ebpf; the agent finds
//! the pinned maps under `<bpffs-root>/<NAME>`. Ports are stored in network
//! byte order, as they sit in packets, so the datapath never swaps bytes.

use crate::Addr;

pub const MAP_FRONTENDS: &str = "FRONTENDS";
pub const MAP_BACKEND_SLOTS: &str = "BACKEND_SLOTS";
pub const MAP_BACKENDS: &str = "BACKENDS";
pub const MAP_CONNTRACK: &str = "CONNTRACK";
pub const MAP_SERVICE_NAMES: &str = "SERVICE_NAMES";
pub const MAP_COUNTERS: &str = "COUNTERS";

pub const MAX_FRONTENDS: u32 = 262_144;
pub const MAX_BACKEND_SLOTS: u32 = 1_048_576;
pub const MAX_BACKENDS: u32 = 1_048_576;
pub const MAX_CONNTRACK: u32 = 131_072;
pub const MAX_SERVICE_NAMES: u32 = 262_144;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// Which clients a frontend entry answers. The model decides the backend set
/// per scope (traffic policies); the datapath only classifies the source.
pub const SCOPE_INTERNAL: u8 = 0;
pub const SCOPE_EXTERNAL: u8 = 1;

/// A service frontend: the destination a client dials.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct FrontendKey {
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}

/// Frontend kinds, kept in `ServiceEntry::kind` for `dump`.
pub const KIND_CLUSTER_IP: u8 = 0;
pub const KIND_NODE_PORT: u8 = 1;
pub const KIND_EXTERNAL_IP: u8 = 2;
pub const KIND_LOAD_BALANCER: u8 = 3;

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct ServiceEntry {
    /// Identifies the backend set in `BACKEND_SLOTS` and the name in `SERVICE_NAMES`.
    pub service_id: u32,
    /// Slots 0..backend_count are filled; 0 means no usable endpoint.
    pub backend_count: u32,
    pub kind: u8,
    pub flags: u8,
    pub _pad: u16,
    pub affinity_timeout_s: u32,
}

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct SlotKey {
    pub service_id: u32,
    pub slot: u32,
}

pub const BACKEND_READY: u8 = 1 << 0;
pub const BACKEND_SERVING: u8 = 1 << 1;
pub const BACKEND_TERMINATING: u8 = 1 << 2;
pub const BACKEND_LOCAL: u8 = 1 << 3;

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct Backend {
    pub addr: Addr,
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// A packet's tuple as it arrived. Conntrack holds two entries per flow: the
/// original direction (client -> frontend) and the reply direction
/// (backend -> client), so either packet finds its translation in one lookup.
#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, Default)]
pub struct CtKey {
    pub src: Addr,
    pub dst: Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// `CtEntry::direction`
pub const CT_ORIGINAL: u8 = 0;
pub const CT_REPLY: u8 = 1;

#[repr(C)]
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct CtEntry {
    /// ORIGINAL: rewrite the destination to `nat_addr:nat_port` (the backend).
    /// REPLY: rewrite the source to `nat_addr:nat_port` (the frontend).
    pub nat_addr: Addr,
    pub nat_port: u16,
    pub direction: u8,
    pub _pad: u8,
    pub service_id: u32,
    /// The backend chosen; an ORIGINAL entry whose backend is gone is re-balanced.
    pub backend_id: u32,
    pub _pad2: u32,
    /// bpf_ktime_get_ns() at creation and at the last packet.
    pub created_ns: u64,
    pub last_seen_ns: u64,
}

pub const SERVICE_NAME_LEN: usize = 248;

/// `namespace/name:port-name`, for people: the datapath never reads it.
#[repr(C)]
#[derive(Copy, Clone)]
pub struct ServiceName {
    pub len: u32,
    pub scope: u8,
    pub _pad: [u8; 3],
    pub bytes: [u8; SERVICE_NAME_LEN],
}

impl ServiceName {
    /// Longer names are cut at a character boundary.
    pub fn new(name: &str, scope: u8) -> Self {
        let mut end = name.len().min(SERVICE_NAME_LEN);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; SERVICE_NAME_LEN];
        bytes[..end].copy_from_slice(&name.as_bytes()[..end]);
        ServiceName { len: end as u32, scope, _pad: [0; 3], bytes }
    }

    pub fn as_str(&self) -> &str {
        let len = (self.len as usize).min(SERVICE_NAME_LEN);
        core::str::from_utf8(&self.bytes[..len]).unwrap_or("<invalid name>")
    }
}

/// Indexes into the per-CPU `COUNTERS` array.
#[repr(u32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Not for a service, passed untouched.
    Passed = 0,
    /// First packet of a flow to a service: backend chosen, translated.
    NewFlow = 1,
    /// Packet of a known flow, translated.
    Established = 2,
    /// Reply from a backend, reverse-translated.
    Reply = 3,
    /// Service with no usable backend.
    NoBackend = 4,
    /// Conntrack insert failed (map full beyond LRU eviction).
    CtFull = 5,
    /// Truncated or malformed headers: passed untouched.
    Malformed = 6,
    /// IP fragment: passed untouched.
    Fragment = 7,
    /// A known flow whose backend vanished, re-balanced.
    Rebalanced = 8,
    /// A checksum/store helper failed: dropped rather than sent corrupt.
    RewriteFailed = 9,
}

pub const COUNTER_NAMES: [&str; 10] = [
    "passed", "new_flow", "established", "reply", "no_backend", "ct_full", "malformed",
    "fragment", "rebalanced", "rewrite_failed",
];
pub const MAX_COUNTERS: u32 = COUNTER_NAMES.len() as u32;

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all are #[repr(C)] plain data with explicit padding fields.
    unsafe impl aya::Pod for FrontendKey {}
    unsafe impl aya::Pod for ServiceEntry {}
    unsafe impl aya::Pod for SlotKey {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtEntry {}
    unsafe impl aya::Pod for ServiceName {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_hidden_padding() {
        // The kernel hashes keys byte for byte: implicit padding would make equal
        // keys differ. These sizes are the sum of the fields.
        assert_eq!(size_of::<FrontendKey>(), 20);
        assert_eq!(size_of::<ServiceEntry>(), 16);
        assert_eq!(size_of::<SlotKey>(), 8);
        assert_eq!(size_of::<Backend>(), 20);
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<CtEntry>(), 48);
        assert_eq!(size_of::<ServiceName>(), 8 + SERVICE_NAME_LEN);
    }

    #[test]
    fn service_name_cuts_at_char_boundary() {
        let long = "é".repeat(200);
        let n = ServiceName::new(&long, SCOPE_INTERNAL);
        assert!(n.as_str().len() <= SERVICE_NAME_LEN);
        assert!(n.as_str().chars().all(|c| c == 'é'));
        assert_eq!(ServiceName::new("default/web:http", 0).as_str(), "default/web:http");
    }
}
