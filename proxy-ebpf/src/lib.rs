#![no_std]
// The library target lets `cargo check --workspace` see this crate on the host.
