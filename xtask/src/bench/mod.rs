//! `cargo xtask bench`: measures ebpf-proxy against its peers in one run and
//! writes docs/benchmarks.md with its figures under docs/bench/. Needs root.
//!
//! One module per family: `micro` (BPF_PROG_TEST_RUN), `traffic` (real
//! traffic in namespaces, with the kube-proxy rule sets and no proxy beside
//! it), `control` (sync time, change latency, memory), `flood` (spoofed SYN
//! floods against established flows, beside kube-proxy's nftables rules),
//! `pps` (packets per second a node forwards for a NodePort: XDP, TC and
//! the kube-proxy rule sets);
//! `report` writes the page and `plot` the figures.

mod control;
mod flood;
mod micro;
mod plot;
mod pps;
mod report;
mod traffic;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::{Context, Result, ensure};
use clap::{Args, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Family {
    Micro,
    Traffic,
    Control,
    Flood,
    Pps,
}

#[derive(Args, Debug)]
pub struct Options {
    /// Run only these families (comma-separated); default: all.
    #[arg(long, value_delimiter = ',', value_name = "FAMILY[,FAMILY]")]
    only: Vec<Family>,
    /// Shorter windows and fewer samples: a smoke run, not numbers to publish.
    #[arg(long)]
    quick: bool,
    /// Where benchmarks.md and bench/*.svg go.
    #[arg(long, value_name = "DIR", default_value = "docs")]
    out: PathBuf,
}

/// What one invocation measured.
#[derive(Default)]
pub struct Measured {
    pub micro: Option<micro::Results>,
    pub traffic: Option<traffic::Results>,
    pub control: Option<control::Results>,
    pub flood: Option<flood::Results>,
    pub pps: Option<pps::Results>,
    pub command: String,
    pub wall: Duration,
}

pub fn run(opts: &Options) -> Result<ExitCode> {
    ensure!(proxy_tests::is_root(), "benchmarks need root (BPF, network namespaces)");
    let started = std::time::Instant::now();
    let wants = |f: Family| opts.only.is_empty() || opts.only.contains(&f);
    // The micro-benchmark runs the BPF object xtask embeds; only the other
    // families start the agent, so only they need its release build.
    if wants(Family::Traffic) || wants(Family::Control) || wants(Family::Flood) || wants(Family::Pps) {
        let bin = crate::cargo::build_agent(true)?;
        // The tests' helpers start the agent named by this variable; set
        // before any thread exists.
        unsafe { std::env::set_var("EBPF_PROXY_BIN", &bin) };
    }
    // The control plane's API figures are taken against kapisrv.
    if wants(Family::Control) {
        let kapisrv = crate::kapisrv::ensure()?;
        unsafe { std::env::set_var("EBPF_PROXY_KAPISRV_BIN", &kapisrv) };
    }
    let work = tempfile_dir()?;

    let mut m = Measured { command: command_line(opts), ..Measured::default() };
    if wants(Family::Micro) {
        eprintln!("==> datapath micro-benchmark");
        let (samples, repeat) = if opts.quick { (500, 10_000) } else { (10_000, 1_000_000) };
        m.micro = Some(micro::run(samples, repeat)?);
    }
    if wants(Family::Traffic) {
        eprintln!("==> real traffic");
        let (warmup, window, rounds) = if opts.quick {
            (Duration::from_millis(200), Duration::from_millis(500), 1)
        } else {
            (Duration::from_millis(300), Duration::from_millis(1500), 3)
        };
        m.traffic = Some(traffic::run(work.path(), warmup, window, rounds)?);
    }
    if wants(Family::Control) {
        eprintln!("==> control plane");
        m.control = Some(control::run(work.path(), if opts.quick { 10 } else { 50 })?);
    }
    if wants(Family::Flood) {
        eprintln!("==> SYN flood");
        let (window, rates): (_, &[u32]) = if opts.quick {
            (Duration::from_secs(1), &[10_000, 40_000])
        } else {
            (Duration::from_secs(2), &[10_000, 20_000, 40_000, 80_000, 160_000, 320_000])
        };
        m.flood = Some(flood::run(work.path(), window, rates)?);
    }
    if wants(Family::Pps) {
        eprintln!("==> packets per second through a NodePort");
        let (warmup, window, rounds) = if opts.quick {
            (Duration::from_millis(500), Duration::from_secs(1), 1)
        } else {
            (Duration::from_secs(1), Duration::from_secs(2), 3)
        };
        m.pps = Some(pps::run(work.path(), warmup, window, rounds)?);
    }
    m.wall = started.elapsed();
    let out = crate::cargo::workspace_root().join(&opts.out);
    report::write(&out, &m)?;
    eprintln!("==> wrote {} ({:.0}s)", out.join("benchmarks.md").display(), m.wall.as_secs_f64());
    Ok(ExitCode::SUCCESS)
}

fn command_line(opts: &Options) -> String {
    let mut s = String::from("./x bench");
    if !opts.only.is_empty() {
        let names: Vec<String> =
            opts.only.iter().map(|f| f.to_possible_value().unwrap().get_name().to_string()).collect();
        s.push_str(&format!(" --only {}", names.join(",")));
    }
    if opts.quick {
        s.push_str(" --quick");
    }
    s
}

/// Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait).
fn cpu_busy() -> Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("empty /proc/stat")?;
    // user nice system idle iowait irq softirq steal (guest time is in user already).
    let ticks: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|f| f.parse().unwrap_or(0)).collect();
    let busy: u64 = ticks.iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
    // In USER_HZ, 100 on Linux.
    Ok(busy as f64 / 100.0)
}

/// Waits, at most `max`, until the machine is nearly idle: under a fifth
/// of a CPU busy over 100 ms. The kernel frees a torn-down namespace and
/// its maps in the background (~240 000 entries after a 10 000-Service
/// run), and a start timed on top of that would measure both.
fn wait_for_quiet(max: Duration) -> Result<()> {
    let window = Duration::from_millis(100);
    let deadline = std::time::Instant::now() + max;
    let mut before = cpu_busy()?;
    while std::time::Instant::now() < deadline {
        std::thread::sleep(window);
        let now = cpu_busy()?;
        if now - before < 0.2 * window.as_secs_f64() {
            break;
        }
        before = now;
    }
    Ok(())
}

/// Scratch space for manifests and rule files, removed at the end.
fn tempfile_dir() -> Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("ebpf-proxy-bench-").tempdir()?)
}
