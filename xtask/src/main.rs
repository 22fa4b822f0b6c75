//! `cargo xtask` — build, test and demo ebpf-proxy. Normally started through
//! `./x`, which installs the toolchain, bpf-linker and system packages first.

mod bench;
mod build;
mod cargo;
mod demo;
mod image;
mod kapisrv;
mod test;
mod vm;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "ebpf-proxy developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build the agent and print the path of the `ebpf-proxy` binary.
    Build(build::Options),
    /// Build everything and run the whole test suite (needs root).
    Test(test::Options),
    /// Build the agent and run the demo topology (needs root).
    Demo,
    /// Build an OCI image archive of the agent (no container engine needed).
    Image(image::Options),
    /// Benchmarks against kube-proxy's rule sets; writes docs/benchmarks.md (needs root).
    Bench(bench::Options),
    /// The integration suites inside QEMU on Debian's kernels (needs root).
    VmTest(vm::Options),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Build(opts) => build::run(&opts),
        Command::Test(opts) => test::run(&opts),
        Command::Demo => demo::run(),
        Command::Image(opts) => image::run(&opts),
        Command::Bench(opts) => bench::run(&opts),
        Command::VmTest(opts) => vm::run(&opts),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
