//! Not unit tests: the packet generator and the sink of `./x bench --only
//! pps` (xtask/src/bench/pps.rs, tests/src/bench/xdp_gen.rs).
//!
//! `xdp_pktgen` runs under BPF_PROG_TEST_RUN in live-frames mode: each run
//! writes the host's UDP header template into the frame, gives it the next
//! source port (one flow per port, `PPS_CONFIG[0]` of them) and sends it
//! out of the generator's veth (XDP_TX). `xdp_pktsink`, native XDP on that
//! veth, counts what the node forwarded back (IPv4 UDP to `PPS_CONFIG[1]`,
//! so ICMP errors and strays never count) and drops it. `xdp_pktreflect`,
//! native XDP on the node's veth, is the bench's floor: it turns each frame
//! straight around (Ethernet addresses swapped, XDP_TX), so the generator,
//! the veth's two crossings and the sink are all a packet costs.

use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};

/// Ethernet, IPv4 without options, UDP.
pub const HEADER: usize = 42;
const _: () = assert!(HEADER % 2 == 0);
const UDP_SPORT: usize = 34;
const UDP_DPORT: usize = 36;
const UDP_CHECK: usize = 40;

#[map]
static PPS_HEADER: Array<[u8; HEADER]> = Array::with_max_entries(1, 0);

/// [flows, the UDP destination port the sink counts]
#[map]
static PPS_CONFIG: Array<u32> = Array::with_max_entries(2, 0);

#[map]
static PPS_SEQ: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

#[map]
static PPS_SUNK: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[xdp]
pub fn xdp_pktgen(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + HEADER > end {
        return xdp_action::XDP_ABORTED;
    }
    let (Some(header), Some(flows), Some(seq)) = (PPS_HEADER.get(0), PPS_CONFIG.get(0), PPS_SEQ.get_ptr_mut(0)) else {
        return xdp_action::XDP_ABORTED;
    };
    // Live frames keep what the last run, or the node that forwarded the
    // frame back, wrote into the page: the whole header goes in every time.
    // A 16-bit word at a time: a plain array copy compiles to a call of the
    // object's byte-wise memmove, a loop of 42 rounds per frame. (The frame
    // starts at an even address: XDP's headroom is even.)
    let (from, to) = ((header as *const [u8; HEADER]).cast::<u16>(), start as *mut u16);
    for i in 0..HEADER / 2 {
        // SAFETY: both inside their buffers (`start + HEADER <= end`), aligned.
        unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) };
    }
    let n = unsafe {
        let n = *seq;
        *seq = n.wrapping_add(1);
        n
    };
    let port = 1024u16.wrapping_add((n % (*flows).max(1)) as u16);
    unsafe {
        *((start + UDP_SPORT) as *mut [u8; 2]) = port.to_be_bytes();
        // IPv4 UDP without a checksum: nothing to fix after the port.
        *((start + UDP_CHECK) as *mut [u8; 2]) = [0, 0];
    }
    xdp_action::XDP_TX
}

#[xdp]
pub fn xdp_pktsink(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + HEADER > end {
        return xdp_action::XDP_DROP;
    }
    let (ethertype, proto, dport) = unsafe {
        (
            *((start + 12) as *const [u8; 2]),
            *((start + 23) as *const u8),
            *((start + UDP_DPORT) as *const [u8; 2]),
        )
    };
    let wanted = PPS_CONFIG.get(1).copied().unwrap_or(0);
    if ethertype == [0x08, 0x00] && proto == 17 && u32::from(u16::from_be_bytes(dport)) == wanted {
        if let Some(count) = PPS_SUNK.get_ptr_mut(0) {
            unsafe { *count += 1 };
        }
    }
    xdp_action::XDP_DROP
}

#[xdp]
pub fn xdp_pktreflect(ctx: XdpContext) -> u32 {
    let (start, end) = (ctx.data(), ctx.data_end());
    if start + HEADER > end {
        return xdp_action::XDP_DROP;
    }
    unsafe {
        let eth = start as *mut [[u8; 6]; 2];
        let [dst, src] = *eth;
        *eth = [src, dst];
    }
    xdp_action::XDP_TX
}
