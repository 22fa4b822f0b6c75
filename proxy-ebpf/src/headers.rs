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

// TCP: the header without options, offsets in it, flags.
pub const TCP_HLEN: usize = 20;
pub const TCP_SEQ_OFF: usize = 4;
pub const TCP_ACK_OFF: usize = 8;
pub const TCP_FLAGS_OFF: usize = 13;
pub const TCP_CSUM_OFF: usize = 16;
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

// UDP.
pub const UDP_HLEN: usize = 8;
pub const UDP_CSUM_OFF: usize = 6;

// ICMP and ICMPv6: type, code, checksum and a 4-byte rest, then the quote.
pub const ICMP_HLEN: usize = 8;
pub const ICMP_CSUM_OFF: usize = 2;
