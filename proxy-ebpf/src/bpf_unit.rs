//! The BPF unit tests' object: one small TC program per operation of a
//! concern (conntrack, nat, lb, reject), each running that concern's own
//! code on the packet it is given, as Cilium's bpf/tests do. The host
//! (tests/tests/bpf_unit.rs) fills the maps, runs a program with
//! BPF_PROG_TEST_RUN and checks what came out: the verdict, the frame, the
//! maps, and the program's report (`unit`).
//!
//! The concerns' modules are the production files, compiled here as they
//! are (the same `crate::` paths); only `unit/` is test code. Built with the
//! `unit` feature, for the tests crate only: the agent's object (`proxy`,
//! main.rs) is built without it and holds none of this.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// Each test calls a few of the modules' functions; the rest go unused here.
#![cfg_attr(target_arch = "bpf", allow(dead_code))]

#[cfg(target_arch = "bpf")]
mod conntrack;
#[cfg(target_arch = "bpf")]
mod context;
#[cfg(target_arch = "bpf")]
mod family;
#[cfg(target_arch = "bpf")]
mod fragment;
#[cfg(target_arch = "bpf")]
mod headers;
#[cfg(target_arch = "bpf")]
mod l2;
#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod nat;
#[cfg(target_arch = "bpf")]
mod packet;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod reject;
#[cfg(target_arch = "bpf")]
mod sctp;
#[cfg(target_arch = "bpf")]
mod skb;

#[cfg(target_arch = "bpf")]
mod unit;

#[cfg(target_arch = "bpf")]
mod program {
    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo) -> ! {
        loop {}
    }

    #[unsafe(link_section = "license")]
    #[unsafe(no_mangle)]
    static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
