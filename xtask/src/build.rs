//! `xtask build [--release]`

use std::process::ExitCode;

use anyhow::Result;

#[derive(clap::Args)]
pub struct Options {
    /// Build with the release profile.
    #[arg(long)]
    release: bool,
}

pub fn run(opts: &Options) -> Result<ExitCode> {
    let bin = crate::cargo::build_agent(opts.release)?;
    println!("{}", bin.display());
    Ok(ExitCode::SUCCESS)
}
