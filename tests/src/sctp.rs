//! Crafted SCTP for the tests: this kernel has no SCTP module, so packets are
//! built here (common header, INIT / INIT-ACK / DATA / ABORT chunks, CRC32c
//! from the `crc32c` crate), sent from a raw IPv4 socket or a packet socket,
//! and captured with a packet socket. etherparse does not parse SCTP; the
//! 12-byte common header is read by hand.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use etherparse::{IpNumber, Ipv4HeaderSlice, PacketBuilder};

use crate::netns::Netns;

pub const IPPROTO_SCTP: u8 = 132;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_ALL: u16 = 0x0003;

pub const CHUNK_DATA: u8 = 0;
pub const CHUNK_INIT: u8 = 1;
pub const CHUNK_INIT_ACK: u8 = 2;
pub const CHUNK_ABORT: u8 = 6;

/// Chunks as RFC 9260 lays them out: type, flags, length, value, padded to 4.
pub mod chunk {
    use super::*;

    fn chunk(kind: u8, flags: u8, value: &[u8]) -> Vec<u8> {
        let mut c = vec![kind, flags];
        c.extend_from_slice(&((4 + value.len()) as u16).to_be_bytes());
        c.extend_from_slice(value);
        c.resize(c.len().next_multiple_of(4), 0);
        c
    }

    fn init_value(tag: u32, tsn: u32) -> Vec<u8> {
        let mut v = tag.to_be_bytes().to_vec();
        v.extend_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
        v.extend_from_slice(&10u16.to_be_bytes()); // outbound streams
        v.extend_from_slice(&10u16.to_be_bytes()); // inbound streams
        v.extend_from_slice(&tsn.to_be_bytes());
        v
    }

    pub fn init(tag: u32) -> Vec<u8> {
        chunk(CHUNK_INIT, 0, &init_value(tag, 1000))
    }

    /// With a State Cookie parameter (type 7), as INIT-ACK must carry.
    pub fn init_ack(tag: u32, cookie: &[u8]) -> Vec<u8> {
        let mut v = init_value(tag, 5000);
        v.extend_from_slice(&7u16.to_be_bytes());
        v.extend_from_slice(&((4 + cookie.len()) as u16).to_be_bytes());
        v.extend_from_slice(cookie);
        v.resize(v.len().next_multiple_of(4), 0);
        chunk(CHUNK_INIT_ACK, 0, &v)
    }

    /// One complete user message (B and E flags) on stream 0.
    pub fn data(tsn: u32, payload: &[u8]) -> Vec<u8> {
        let mut v = tsn.to_be_bytes().to_vec();
        v.extend_from_slice(&[0, 0, 0, 0]); // stream id, stream sequence number
        v.extend_from_slice(&0u32.to_be_bytes()); // payload protocol id
        v.extend_from_slice(payload);
        chunk(CHUNK_DATA, 0x03, &v)
    }

    /// ABORT with a "User-Initiated Abort" cause (code 12) and no T bit.
    pub fn abort() -> Vec<u8> {
        chunk(CHUNK_ABORT, 0, &[0, 12, 0, 4])
    }
}

/// The CRC32c of an SCTP packet per the reference crate, checksum field as zero.
pub fn reference_checksum(sctp: &[u8]) -> u32 {
    let mut z = sctp.to_vec();
    z[8..12].fill(0);
    crc32c::crc32c(&z)
}

/// The checksum field as the CRC value (SCTP puts it on the wire LSB first).
pub fn stored_checksum(sctp: &[u8]) -> u32 {
    u32::from_le_bytes(sctp[8..12].try_into().unwrap())
}

/// An SCTP packet (common header + chunks) with a valid CRC32c.
pub fn packet(sport: u16, dport: u16, vtag: u32, chunks: &[Vec<u8>]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    for c in chunks {
        p.extend_from_slice(c);
    }
    let crc = reference_checksum(&p);
    p[8..12].copy_from_slice(&crc.to_le_bytes());
    p
}

/// Ethernet + IPv4 (valid header checksum) around an SCTP packet.
pub fn frame(src: [u8; 4], dst: [u8; 4], sctp: &[u8], src_mac: [u8; 6], dst_mac: [u8; 6]) -> Vec<u8> {
    let mut v = Vec::new();
    PacketBuilder::ethernet2(src_mac, dst_mac)
        .ipv4(src, dst, 64)
        .write(&mut v, IpNumber(IPPROTO_SCTP), sctp)
        .expect("building an SCTP frame");
    v
}

/// What a test checks of an SCTP packet seen on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub vtag: u32,
    /// The checksum field, and the CRC32c the reference computes.
    pub stored_crc: u32,
    pub reference_crc: u32,
    pub ip_checksum_ok: bool,
    /// The type of each chunk.
    pub chunks: Vec<u8>,
    /// The SCTP bytes (common header + chunks), up to the IP total length.
    pub sctp: Vec<u8>,
}

impl Seen {
    pub fn crc_ok(&self) -> bool {
        self.stored_crc == self.reference_crc
    }
}

/// Parses an Ethernet frame holding IPv4 + SCTP.
pub fn parse_frame(frame: &[u8]) -> Result<Seen> {
    anyhow::ensure!(frame.len() > ETH_HLEN, "frame of {} bytes", frame.len());
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    anyhow::ensure!(ethertype == ETH_P_IP, "ethertype {ethertype:#06x}, not IPv4");
    parse_ipv4(&frame[ETH_HLEN..])
}

/// Parses an IPv4 datagram holding SCTP (trailing bytes past the IP total
/// length, such as Ethernet padding, are ignored).
pub fn parse_ipv4(datagram: &[u8]) -> Result<Seen> {
    let ip = Ipv4HeaderSlice::from_slice(datagram).context("IPv4 header")?;
    anyhow::ensure!(ip.protocol() == IpNumber(IPPROTO_SCTP), "IP protocol {:?}, not SCTP", ip.protocol());
    let header = ip.to_header();
    let ip_checksum_ok = header.calc_header_checksum() == ip.header_checksum();
    let end = usize::from(ip.total_len());
    anyhow::ensure!(end <= datagram.len(), "IP total length {end} past the {} bytes captured", datagram.len());
    let sctp = &datagram[ip.slice().len()..end];
    anyhow::ensure!(sctp.len() >= 12, "SCTP packet of {} bytes", sctp.len());
    let mut chunks = Vec::new();
    let mut at = 12;
    while at + 4 <= sctp.len() {
        chunks.push(sctp[at]);
        let len = usize::from(u16::from_be_bytes([sctp[at + 2], sctp[at + 3]]));
        anyhow::ensure!(len >= 4, "chunk at {at} with length {len}");
        at += len.next_multiple_of(4);
    }
    Ok(Seen {
        src: SocketAddrV4::new(ip.source_addr(), u16::from_be_bytes([sctp[0], sctp[1]])),
        dst: SocketAddrV4::new(ip.destination_addr(), u16::from_be_bytes([sctp[2], sctp[3]])),
        vtag: u32::from_be_bytes(sctp[4..8].try_into().unwrap()),
        stored_crc: stored_checksum(sctp),
        reference_crc: reference_checksum(sctp),
        ip_checksum_ok,
        chunks,
        sctp: sctp.to_vec(),
    })
}

// ---------------------------------------------------------------- sockets

fn check(ret: libc::c_int, what: &str) -> Result<libc::c_int> {
    if ret < 0 {
        Err(std::io::Error::last_os_error()).with_context(|| what.to_string())
    } else {
        Ok(ret)
    }
}

fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T, what: &str) -> Result<()> {
    let ret = unsafe {
        libc::setsockopt(fd.as_raw_fd(), level, name, (value as *const T).cast(), size_of::<T>() as libc::socklen_t)
    };
    check(ret, what).map(drop)
}

/// Sends `sctp` (common header + chunks) to `dst` from a raw IPv4 socket in
/// `ns`: the kernel adds the IP header with the namespace's source address.
/// Raw sockets of protocol 132 work without the SCTP module.
pub fn send_raw(ns: &Netns, dst: Ipv4Addr, sctp: Vec<u8>) -> Result<()> {
    ns.run(move || -> Result<()> {
        let fd = check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, IPPROTO_SCTP.into()) }, "raw SCTP socket")?;
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let to = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(dst.octets()) },
            sin_zero: [0; 8],
        };
        let sent = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                sctp.as_ptr().cast(),
                sctp.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        anyhow::ensure!(sent == sctp.len() as isize, "sendto {dst}: {}", std::io::Error::last_os_error());
        Ok(())
    })?
}

fn ifindex(name: &str) -> Result<libc::c_int> {
    let c = std::ffi::CString::new(name)?;
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    anyhow::ensure!(idx != 0, "no interface {name}: {}", std::io::Error::last_os_error());
    Ok(idx as libc::c_int)
}

fn packet_socket(ifname: &str, protocol: u16) -> Result<OwnedFd> {
    let fd = check(
        unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, libc::c_int::from(protocol.to_be())) },
        "packet socket",
    )?;
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = protocol.to_be();
    addr.sll_ifindex = ifindex(ifname)?;
    let ret = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    check(ret, &format!("bind packet socket to {ifname}"))?;
    Ok(fd)
}

/// `struct virtio_net_hdr` (include/uapi/linux/virtio_net.h).
#[repr(C)]
#[derive(Default)]
struct VirtioNetHdr {
    flags: u8,
    gso_type: u8,
    hdr_len: u16,
    gso_size: u16,
    csum_start: u16,
    csum_offset: u16,
}
const VIRTIO_NET_HDR_F_NEEDS_CSUM: u8 = 1;
const PACKET_VNET_HDR: libc::c_int = 15;

/// Sends an Ethernet frame on `ifname` in `ns` from a packet socket with a
/// virtio_net_hdr asking for the checksum to be completed later
/// (NEEDS_CSUM, from the SCTP header, field at +8): the kernel turns that
/// into an skb with `ip_summed == CHECKSUM_PARTIAL`, the state of a locally
/// sent packet whose checksum is offloaded. The frame's checksum field is
/// sent as given.
pub fn send_checksum_partial(ns: &Netns, ifname: &str, frame: Vec<u8>) -> Result<()> {
    let ifname = ifname.to_string();
    ns.run(move || -> Result<()> {
        let fd = packet_socket(&ifname, ETH_P_IP)?;
        setsockopt(&fd, libc::SOL_PACKET, PACKET_VNET_HDR, &1 as &libc::c_int, "PACKET_VNET_HDR")?;
        let ihl = usize::from(frame[ETH_HLEN] & 0x0f) * 4;
        let hdr = VirtioNetHdr {
            flags: VIRTIO_NET_HDR_F_NEEDS_CSUM,
            csum_start: (ETH_HLEN + ihl) as u16,
            csum_offset: 8,
            ..Default::default()
        };
        let hdr_bytes =
            unsafe { std::slice::from_raw_parts((&hdr as *const VirtioNetHdr).cast::<u8>(), size_of::<VirtioNetHdr>()) };
        let mut buf = hdr_bytes.to_vec();
        buf.extend_from_slice(&frame);
        let sent = unsafe { libc::send(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len(), 0) };
        anyhow::ensure!(sent == buf.len() as isize, "send on {ifname}: {}", std::io::Error::last_os_error());
        Ok(())
    })?
}

/// `tp_status` bits of PACKET_AUXDATA (include/uapi/linux/if_packet.h).
pub const TP_STATUS_CSUMNOTREADY: u32 = 1 << 3;
const PACKET_AUXDATA: libc::c_int = 8;

/// A packet socket on one interface of a namespace, open from creation on, so
/// nothing sent after `open` is missed.
pub struct Capture {
    fd: OwnedFd,
    ifname: String,
}

/// A captured SCTP packet and its PACKET_AUXDATA status.
#[derive(Debug)]
pub struct Captured {
    pub seen: Seen,
    /// `TP_STATUS_CSUMNOTREADY` set: the checksum is still to be computed
    /// (CHECKSUM_PARTIAL), the bytes carry no final checksum yet.
    pub checksum_not_ready: bool,
}

impl Capture {
    pub fn open(ns: &Netns, ifname: &str) -> Result<Capture> {
        let name = ifname.to_string();
        let fd = ns.run(move || -> Result<OwnedFd> {
            let fd = packet_socket(&name, ETH_P_ALL)?;
            setsockopt(&fd, libc::SOL_PACKET, PACKET_AUXDATA, &1 as &libc::c_int, "PACKET_AUXDATA")?;
            Ok(fd)
        })??;
        Ok(Capture { fd, ifname: ifname.to_string() })
    }

    /// The first incoming SCTP packet that `want` accepts, within `timeout`.
    pub fn next(&self, timeout: Duration, want: impl Fn(&Seen) -> bool) -> Result<Captured> {
        let deadline = Instant::now() + timeout;
        let mut skipped = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            anyhow::ensure!(
                !left.is_zero(),
                "no matching SCTP packet on {} within {timeout:?}; other SCTP packets seen: {skipped:?}",
                self.ifname
            );
            let Some((frame, status, outgoing)) = self.recv(left)? else { continue };
            if outgoing {
                continue;
            }
            let Ok(seen) = parse_frame(&frame) else { continue };
            if want(&seen) {
                return Ok(Captured { seen, checksum_not_ready: status & TP_STATUS_CSUMNOTREADY != 0 });
            }
            skipped.push(format!("{} -> {}", seen.src, seen.dst));
        }
    }

    /// One frame, its tp_status and whether it was outgoing; None on timeout.
    fn recv(&self, timeout: Duration) -> Result<Option<(Vec<u8>, u32, bool)>> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        if check(unsafe { libc::poll(&mut pfd, 1, ms) }, "poll")? == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; 65_536];
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let mut control = [0u64; 16];
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = (&mut from as *mut libc::sockaddr_ll).cast();
        msg.msg_namelen = size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control);
        let n = check(unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, 0) } as libc::c_int, "recvmsg")?;
        buf.truncate(n as usize);
        let mut status = 0;
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        while !cmsg.is_null() {
            let c = unsafe { &*cmsg };
            if c.cmsg_level == libc::SOL_PACKET && c.cmsg_type == PACKET_AUXDATA {
                let aux = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::tpacket_auxdata>()) };
                status = aux.tp_status;
            }
            cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
        }
        Ok(Some((buf, status, from.sll_pkttype == libc::PACKET_OUTGOING as u8)))
    }
}
