//! Protocol header layouts: lengths, field offsets, type values and flags,
//! defined once for every program (Cilium's `bpf/lib` keeps them in its
//! protocol headers the same way).

// Ethernet.
pub const ETH_HLEN: usize = 14;
pub const ETH_ALEN: usize = 6;
pub const ETH_TYPE_OFF: usize = 12;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;

// IPv4: the fixed header, and offsets in it.
pub const IPV4_HLEN: usize = 20;
pub const IPV4_CSUM_OFF: usize = 10;
pub const IPV4_SRC_OFF: usize = 12;
pub const IPV4_DST_OFF: usize = 16;

// IPv6: the fixed header, and offsets in it.
pub const IPV6_HLEN: usize = 40;
pub const IPV6_SRC_OFF: usize = 8;
pub const IPV6_DST_OFF: usize = 24;

// TCP: shared with the agent's tests (the reset is built by proxy-common).
pub use proxy_common::tcp::{
    TCP_ACK, TCP_ACK_OFF, TCP_CSUM_OFF, TCP_FIN, TCP_FLAGS_OFF, TCP_HLEN, TCP_RST, TCP_SEQ_OFF, TCP_SYN,
};

// UDP.
pub const UDP_HLEN: usize = 8;
pub const UDP_CSUM_OFF: usize = 6;

// ICMP and ICMPv6: type, code, checksum and a 4-byte rest, then the quote.
pub const ICMP_HLEN: usize = 8;
pub const ICMP_CSUM_OFF: usize = 2;
