//! A parsed packet: its tuple, where its headers are, and what its TCP flags
//! say about the connection. Written by `parse`, read by every step after it.

use proxy_common::{CtKey, IPPROTO_TCP, IPPROTO_UDP};

use crate::headers::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

pub struct Packet {
    /// The tuple as it arrived (ports in network order).
    pub tuple: CtKey,
    /// Offsets of the IP header (the program's family: `Family`) and of
    /// the L4 ports and checksum.
    pub l3_off: usize,
    pub l4_off: usize,
    pub l4_csum_off: usize,
    /// End of the IP datagram (Ethernet padding may follow): SCTP's CRC
    /// covers everything from `l4_off` to here.
    pub l4_end: usize,
    pub proto: u8,
    /// TCP flags; for SCTP, TCP_SYN when the first chunk is an INIT (see
    /// `sctp::opening_flags`); 0 for UDP.
    pub tcp_flags: u8,
    /// `fragment::NOT_FRAGMENT`, `FIRST` or `LATER`. A later fragment has no
    /// L4 header: its ports are its first's, `l4_csum_off` is 0 and
    /// `tcp_flags` 0.
    pub fragment: u8,
}

impl Packet {
    /// A TCP SYN without ACK: a client opening a connection.
    #[inline(always)]
    pub fn opens_connection(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }

    /// A packet that may start a flow: a TCP SYN, an SCTP INIT, any UDP
    /// datagram (netfilter's NEW, without picking up TCP mid-stream).
    #[inline(always)]
    pub fn may_open_flow(&self) -> bool {
        self.proto == IPPROTO_UDP || self.opens_connection()
    }

    /// A TCP segment with ACK and neither SYN nor RST: a handshake's last
    /// step, or any later segment.
    #[inline(always)]
    pub fn acks_only(&self) -> bool {
        self.proto == IPPROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_ACK
    }

    /// A TCP SYN-ACK: a server answering a connection's opening.
    #[inline(always)]
    pub fn answers_opening(&self) -> bool {
        self.proto == IPPROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN | TCP_ACK
    }

    /// A TCP FIN or RST: this direction of the connection is ending.
    #[inline(always)]
    pub fn closes_connection(&self) -> bool {
        self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }
}
