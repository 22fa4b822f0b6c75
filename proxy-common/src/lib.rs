//! Types shared by the BPF programs and the agent: map keys and values,
//! map names and sizes, flags. Everything here is `#[repr(C)]` plain data so
//! the two sides agree byte for byte.
#![no_std]

pub mod addr;
pub mod crc32c;
pub mod counter;
pub mod csum;
pub mod jhash;
pub mod maglev;
pub mod maps;
pub mod reject_limit;
pub mod tcp;
pub mod unit;

pub use addr::Addr;
pub use counter::{Counter, Verdict};
pub use maglev::*;
pub use maps::*;
