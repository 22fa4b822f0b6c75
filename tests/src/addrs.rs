//! The addresses of the tests' cluster, one world for the packet fixtures
//! and the tests with real traffic: pods in 10.244.0.0/16 (fd00:244::/64),
//! Services in 10.96.0.0/16 (fd00:96::/64). A test whose world differs (an
//! L3 device's pods, a router's far side) names its own.

use std::net::{Ipv4Addr, Ipv6Addr};

/// A pod that dials Services.
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 2);
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 2);
/// The pod behind the Service at `VIP`.
pub const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 11);
pub const BACKEND6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0x11);
/// A ClusterIP.
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);

// Only in the packet fixtures (BPF_PROG_TEST_RUN): no interface holds them.

/// Another ClusterIP (in `fixtures.rs` and `packet_fuzz.rs`, one without endpoints).
pub const VIP_EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// In the service CIDR, no Service's.
pub const UNALLOCATED: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 99);
/// A client outside the cluster, masqueraded.
pub const EXTERNAL: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// The node's address, which masqueraded flows leave with.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);

/// An address as the maps hold it (IPv4 mapped into IPv6).
pub fn addr(ip: impl Into<std::net::IpAddr>) -> proxy_common::Addr {
    proxy_common::Addr::from(ip.into())
}
