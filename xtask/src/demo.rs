//! `xtask demo`: the demo topology from `proxy_tests::demo`.

use std::process::ExitCode;

use anyhow::Result;

pub fn run() -> Result<ExitCode> {
    let bin = crate::cargo::build_agent(false)?;
    proxy_tests::demo::run(&bin)?;
    Ok(ExitCode::SUCCESS)
}
