//! A point-to-point L3 link between two namespaces, as a WireGuard tunnel
//! looks to the node: a tun device in each (link type `none`: packets start
//! at the IP header, no Ethernet), and a thread of the test carrying every
//! packet from one to the other. The devices go with the link.

use std::{
    io::{Read, Write},
    os::fd::{AsRawFd, BorrowedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::{Context, Result};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::netns::Netns;

pub struct TunLink {
    stop: Arc<AtomicBool>,
    relays: Vec<JoinHandle<()>>,
}

/// A tun device named `name`, created in `ns`, not yet up.
pub fn create(ns: &Netns, name: &str) -> Result<tun::Device> {
    let mut config = tun::Configuration::default();
    config.tun_name(name).layer(tun::Layer::L3);
    let device = ns.run(move || tun::create(&config))?.with_context(|| format!("tun device {name} in {}", ns.name))?;
    Ok(device)
}

/// Sets a tun device's link type (ARPHRD_*) while it is down: how a test
/// makes an interface of a type the agent does not handle.
pub fn set_link_type(device: &tun::Device, arphrd: i32) -> Result<()> {
    // TUNSETLINK, _IOW('T', 205, int): the argument is the value itself.
    nix::ioctl_write_int_bad!(tunsetlink, nix::request_code_write!(b'T', 205, std::mem::size_of::<libc::c_int>()));
    unsafe { tunsetlink(device.as_raw_fd(), arphrd) }.context("TUNSETLINK")?;
    Ok(())
}

impl TunLink {
    /// `a_if` in `a` and `b_if` in `b`, up, joined; addresses and routes
    /// are the caller's.
    pub fn new(a: &Netns, a_if: &str, b: &Netns, b_if: &str) -> Result<TunLink> {
        let ends = [create(a, a_if)?, create(b, b_if)?];
        a.ip(&["link", "set", a_if, "up"])?;
        b.ip(&["link", "set", b_if, "up"])?;
        let stop = Arc::new(AtomicBool::new(false));
        let [a_dev, b_dev] = ends;
        let ((a_reader, a_writer), (b_reader, b_writer)) = (a_dev.split(), b_dev.split());
        let relays = vec![relay(a_reader, b_writer, stop.clone()), relay(b_reader, a_writer, stop.clone())];
        Ok(TunLink { stop, relays })
    }
}

/// Carries packets read from `from` to `to` until `stop`.
fn relay(mut from: tun::Reader, mut to: tun::Writer, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        while !stop.load(Ordering::Relaxed) {
            // SAFETY: `from` owns the fd and outlives the poll.
            let fd = unsafe { BorrowedFd::borrow_raw(from.as_raw_fd()) };
            match poll(&mut [PollFd::new(fd, PollFlags::POLLIN)], PollTimeout::from(100u8)) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(_) => return,
            }
            let Ok(n) = from.read(&mut buf) else { return };
            // A full queue on the far side drops the packet, as a link would.
            let _ = to.write(&buf[..n]);
        }
    })
}

impl Drop for TunLink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for relay in self.relays.drain(..) {
            let _ = relay.join();
        }
    }
}
