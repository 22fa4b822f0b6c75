//! The pps bench's packet generator and sink (proxy-ebpf/src/unit/pktgen.rs,
//! in the BPF unit object): `xdp_pktgen` sends a UDP frame, one source
//! port after another, out of a veth with BPF_PROG_TEST_RUN in live-frames
//! mode (the kernel hands each XDP_TX to the veth, as a driver would);
//! `xdp_pktsink` counts on that veth what came back; `xdp_pktreflect`
//! stands in for the node to measure the floor.

use std::{
    net::Ipv4Addr,
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::{Context, Result, ensure};
use aya::{
    maps::{Array, PerCpuArray},
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp},
};
use crate::{bpf_unit::Unit, netns::Netns};

/// Ethernet + IPv4 + UDP, as pktgen.rs rewrites it.
const HEADER: usize = 42;
/// The smallest Ethernet frame (without its FCS).
const FRAME: usize = 60;
/// Runs per BPF_PROG_TEST_RUN call: short enough to stop promptly.
const REPEAT: u32 = 1 << 17;

pub struct Pktgen {
    unit: Unit,
    frame: Vec<u8>,
}

/// The UDP frame the generator sends: `src_mac`/`src` to `dst_mac`/`dst`:`dport`.
pub fn udp_frame(src_mac: [u8; 6], dst_mac: [u8; 6], src: Ipv4Addr, dst: Ipv4Addr, dport: u16) -> Result<Vec<u8>> {
    let builder = etherparse::PacketBuilder::ethernet2(src_mac, dst_mac).ipv4(src.octets(), dst.octets(), 64).udp(1024, dport);
    let payload = [0u8; FRAME - HEADER];
    let mut frame = Vec::with_capacity(FRAME);
    builder.write(&mut frame, &payload)?;
    Ok(frame)
}

impl Pktgen {
    /// Loads the object for one generator: `frame` (see `udp_frame`) over
    /// `flows` source ports; the sink counts IPv4 UDP to `sink_port`.
    pub fn new(label: &str, frame: Vec<u8>, flows: u32, sink_port: u16) -> Result<Pktgen> {
        ensure!(frame.len() >= HEADER, "a {}-byte frame has no UDP header", frame.len());
        let mut unit = Unit::load(label)?;
        let ebpf = unit.ebpf_mut();
        let mut header: Array<_, [u8; HEADER]> = Array::try_from(ebpf.map_mut("PPS_HEADER").context("no PPS_HEADER")?)?;
        header.set(0, &<[u8; HEADER]>::try_from(&frame[..HEADER])?, 0)?;
        let mut config: Array<_, u32> = Array::try_from(ebpf.map_mut("PPS_CONFIG").context("no PPS_CONFIG")?)?;
        config.set(0, &flows, 0)?;
        config.set(1, &u32::from(sink_port), 0)?;
        let prog: &mut Xdp = ebpf.program_mut("xdp_pktgen").context("no xdp_pktgen")?.try_into()?;
        prog.load().context("the verifier refuses xdp_pktgen")?;
        Ok(Pktgen { unit, frame })
    }

    /// The sink on `ifname` in `ns`: the interface the generator sends out of.
    pub fn attach_sink(&mut self, ns: &Netns, ifname: &str) -> Result<()> {
        let unit = &mut self.unit;
        ns.run_borrowing(|| unit.attach_xdp("xdp_pktsink", &[ifname.to_string()]))?
    }

    /// `xdp_pass` on `ifname` in `ns`: a veth takes the generator's frames
    /// only while it runs native XDP (or the proxy's own XDP is there).
    pub fn attach_pass(&mut self, ns: &Netns, ifname: &str) -> Result<()> {
        let unit = &mut self.unit;
        ns.run_borrowing(|| unit.attach_xdp_pass(&[ifname.to_string()]))?
    }

    /// `xdp_pktreflect` on `ifname` in `ns` (the node's end of the veth):
    /// every frame straight back to the sink, the floor of the bench.
    pub fn attach_reflector(&mut self, ns: &Netns, ifname: &str) -> Result<()> {
        let unit = &mut self.unit;
        ns.run_borrowing(|| unit.attach_xdp("xdp_pktreflect", &[ifname.to_string()]))?
    }

    /// Frames the sink counted so far.
    pub fn sunk(&self) -> Result<u64> {
        let map: PerCpuArray<_, u64> = PerCpuArray::try_from(self.unit.ebpf().map("PPS_SUNK").context("no PPS_SUNK")?)?;
        Ok(map.get(&0, 0)?.iter().sum())
    }

    /// Sends out of `ifname` in `ns` until `stop`; the frames it sent.
    pub fn send(&self, ns: &Netns, ifname: &str, stop: &AtomicBool) -> Result<u64> {
        let prog: &Xdp = self.unit.ebpf().program("xdp_pktgen").context("no xdp_pktgen")?.try_into()?;
        ns.run_borrowing(|| {
            let ifindex = nix::net::if_::if_nametoindex(ifname).with_context(|| format!("no interface {ifname}"))?;
            // struct xdp_md: data, data_end (the frame's length), data_meta,
            // ingress_ifindex (where XDP_TX goes), rx_queue_index, egress_ifindex.
            let mut ctx = [0u8; 24];
            ctx[4..8].copy_from_slice(&(self.frame.len() as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let opts = TestRunOptions {
                    data_in: Some(&self.frame),
                    ctx_in: Some(&ctx),
                    repeat: REPEAT,
                    // Batch size 0: the kernel's default (64).
                    attrs: TestRunAttrs::new().xdp_live_frames(0),
                    ..TestRunOptions::new()
                };
                prog.test_run(opts).context("BPF_PROG_TEST_RUN (live frames) of xdp_pktgen")?;
                sent += u64::from(REPEAT);
            }
            Ok(sent)
        })?
    }
}
