//! Spoofed SYN floods: TCP SYNs from random sources, as a SYN flood against
//! a NodePort arrives, sent through a raw socket in the client's namespace.

use std::{
    net::SocketAddrV4,
    time::{Duration, Instant},
};

use anyhow::Result;
use etherparse::PacketBuilder;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::netns::Netns;

/// Sends `count` SYNs to `to` from `ns`, each from a random source in
/// 198.18.0.0/15 (the benchmarking range: nothing there answers) and port;
/// at most `per_second` of them a second, if given. Returns how long it took.
pub fn spoofed_syns(ns: &Netns, to: SocketAddrV4, count: u32, per_second: Option<u32>) -> Result<Duration> {
    ns.run(move || -> Result<Duration> {
        // IPPROTO_RAW: the packet carries its own IP header.
        let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW)))?;
        let dest = SockAddr::from(to);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut packet = Vec::with_capacity(64);
        let started = Instant::now();
        for i in 0..count {
            if let Some(rate) = per_second {
                // Paced in 1 ms batches: sleep until this SYN is due.
                if i % (rate / 1000).max(1) == 0 {
                    let due = started + Duration::from_secs_f64(f64::from(i) / f64::from(rate));
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
            }
            // xorshift64: reproducible, and plenty for spoofed addresses.
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let [a, b, p0, p1, s0, s1, s2, s3] = seed.to_le_bytes();
            packet.clear();
            PacketBuilder::ipv4([198, 18 | (a & 1), b, p0], to.ip().octets(), 64)
                .tcp(u16::from_le_bytes([p1, s0]) | 1024, to.port(), u32::from_le_bytes([s0, s1, s2, s3]), 64240)
                .syn()
                .write(&mut packet, &[])?;
            socket.send_to(&packet, &dest)?;
        }
        Ok(started.elapsed())
    })?
}
