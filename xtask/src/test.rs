//! `xtask test [--test-threads N] [-- ARGS]`: builds everything (kapisrv,
//! the API server of the Kubernetes source's tests, included), runs
//! `cargo test --workspace --no-fail-fast`, and ends with one summary line.

use std::{
    os::unix::fs::MetadataExt as _,
    process::{ExitCode, Stdio},
};

use anyhow::{Context as _, Result};

use crate::cargo::{agent_bin, cargo, existing, run as run_cmd, tee_lines};

#[derive(clap::Args)]
pub struct Options {
    /// Test threads per test binary [default: number of CPUs].
    #[arg(long)]
    test_threads: Option<usize>,
    /// Passed to the test binaries (filters, --nocapture, --ignored, ...).
    #[arg(last = true)]
    args: Vec<String>,
}

pub fn run(opts: &Options) -> Result<ExitCode> {
    if std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0) != 0 {
        eprintln!("xtask: warning: not root: the tests that need root are skipped (ignored, \"needs root\")");
    }

    let kapisrv = crate::kapisrv::ensure_in_background();
    let mut build = cargo();
    build.args(["build", "--workspace", "--all-targets"]);
    run_cmd(build)?;
    let bin = existing(agent_bin(false))?;

    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--no-fail-fast", "--"])
        .env("EBPF_PROXY_BIN", &bin)
        .stdout(Stdio::piped());
    // A kapisrv that would not build fails the tests that need it, not the rest.
    match kapisrv.join().unwrap_or_else(|_| Err(anyhow::anyhow!("the kapisrv build thread panicked"))) {
        Ok(dir) => cmd.env("EBPF_PROXY_KAPISRV_BIN", dir),
        Err(e) => {
            eprintln!("xtask: error: kapisrv: {e:#}");
            cmd.env("EBPF_PROXY_KAPISRV_ERROR", format!("{e:#}"))
        }
    };
    if !opts.args.iter().any(|a| a.starts_with("--test-threads")) {
        let n = opts.test_threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        });
        cmd.arg(format!("--test-threads={n}"));
    }
    cmd.args(&opts.args);

    let mut child = cmd.spawn().with_context(|| format!("running {cmd:?}"))?;
    let mut summary = Summary::default();
    tee_lines(child.stdout.take().unwrap(), std::io::stdout(), |line| summary.add(line))?;
    let status = child.wait()?;

    let ok = status.success() && summary.failed == 0;
    eprintln!(
        "==> test: {} test binaries: {}",
        summary.binaries,
        if ok { "ok".to_string() } else { format!("FAILED ({status})") },
    );
    // The closing line CI reads: "N passed, N failed, N skipped".
    println!("summary: {} passed, {} failed, {} skipped", summary.passed, summary.failed, summary.ignored);
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Totals over libtest's "test result: ok. 3 passed; 0 failed; 1 ignored; ..." lines.
#[derive(Default)]
pub struct Summary {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    pub binaries: u64,
}

impl Summary {
    pub fn add(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return;
        };
        self.binaries += 1;
        for part in rest.split(['.', ';']) {
            let mut words = part.split_whitespace();
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                _ => {}
            }
        }
    }
}
