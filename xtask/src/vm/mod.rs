//! `xtask vm-test [--kernel 5.10|6.1|6.12|7.2|all] [--tests NAME,..] [-- ARGS]`:
//! the integration and conformance suites inside QEMU, on Debian's own
//! kernels, one VM per kernel, ending with one line per kernel.
//!
//! - `debian`: the signed package index and `.deb`s, from apt's mirror;
//! - `kernel`: the newest generic kernel of a series, its modules;
//! - `rootfs`: the cached bookworm userland (mmdebstrap);
//! - `initrd`: userland + modules + `init.sh` as the VM's initramfs;
//! - `suite`: the test binaries and the script that runs them inside;
//! - `boot`: QEMU (KVM where it works, TCG otherwise), the console;
//! - `report`: totals, and where the logs of a failed run are.
//!
//! The workspace is shared read-only over 9p at its own path (the tests
//! have paths under it compiled in), target/vm-test/<series>/ read-write.

mod boot;
mod debian;
mod initrd;
mod kernel;
mod report;
mod rootfs;
mod suite;

use std::{
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use self::{
    boot::{Accel, Share, Vm},
    report::KernelResult,
};
use crate::cargo::{agent_bin, cargo, existing, run as run_cmd, workspace_root};

#[derive(clap::Args)]
pub struct Options {
    /// Debian kernels to boot (comma-separated): 5.10 (bullseye), 6.1
    /// (bookworm), 6.12 (trixie), 7.2 (sid), or all.
    #[arg(long, value_delimiter = ',', default_value = "all", value_name = "SERIES")]
    kernel: Vec<String>,
    /// Run only these test binaries (target names, e.g. clusterip,restart);
    /// default: every binary `cargo test --workspace` runs.
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    tests: Vec<String>,
    /// Force an accelerator; default: KVM if a probe boot of the kernel
    /// works under it (cached), else TCG.
    #[arg(long, value_enum)]
    accel: Option<Accel>,
    /// vCPUs per VM.
    #[arg(long, default_value_t = 2)]
    cpus: usize,
    /// Memory per VM, in MiB (the root filesystem lives in it; the
    /// conformance binary's six agents need 4096: docs/vm-test.md).
    #[arg(long, default_value_t = 4096)]
    memory: u32,
    /// Test threads per test binary [default: --cpus].
    #[arg(long)]
    test_threads: Option<usize>,
    /// Seconds a VM may take to reach init.
    #[arg(long, default_value_t = 180)]
    boot_timeout: u64,
    /// Seconds a VM may run in all, tests included.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
    /// Passed to the test binaries (filters, --nocapture, ...).
    #[arg(last = true)]
    args: Vec<String>,
}

pub fn run(opts: &Options) -> Result<ExitCode> {
    let started = Instant::now();
    let series = selected_series(&opts.kernel)?;
    if fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0) != 0 {
        eprintln!("xtask: warning: not root: building the root filesystem (mmdebstrap) needs root");
    }

    // As `xtask test` builds: the same feature set as `cargo test
    // --workspace`, so the next step finds everything built.
    let mut build = cargo();
    build.args(["build", "--workspace", "--all-targets"]);
    run_cmd(build)?;
    let agent = existing(agent_bin(false))?;
    let tests = suite::build(&opts.tests)?;
    let names: Vec<&str> = tests.iter().map(|t| t.name.as_str()).collect();
    eprintln!("==> vm-test: {} test binaries: {}", tests.len(), names.join(" "));
    let mut args = opts.args.clone();
    if !args.iter().any(|a| a.starts_with("--test-threads")) {
        args.insert(0, format!("--test-threads={}", opts.test_threads.unwrap_or(opts.cpus)));
    }
    // The Kubernetes source's tests start kapisrv: its binaries are shared too.
    let kapisrv = if tests.iter().any(|t| crate::kapisrv::TESTS.contains(&t.name.as_str())) {
        Some(crate::kapisrv::ensure()?)
    } else {
        None
    };
    let script = suite::script(&tests, &agent, kapisrv.as_deref(), &args);

    let target = target_dir()?;
    let mut readonly = vec![workspace_root().to_path_buf()];
    if !target.starts_with(workspace_root()) {
        readonly.push(target.clone());
    }
    readonly.extend(kapisrv.filter(|k| !k.starts_with(workspace_root())));
    if let Some(p) = readonly.iter().find(|p| p.to_string_lossy().contains([' ', ',', '"'])) {
        bail!("{} has a space, comma or quote: it cannot go on the VM's kernel command line", p.display());
    }

    let cache = cache_dir();
    fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let archive = debian::Archive::new(&cache)?;
    let rootfs = rootfs::ensure(&cache, archive.mirror())?;

    let mut results = Vec::new();
    for s in &series {
        let out = target.join("vm-test").join(s);
        let mut result = KernelResult {
            series: s.to_string(),
            release: None,
            accel: None,
            run: None,
            summary: Default::default(),
            verifier: Vec::new(),
            out: out.clone(),
            error: None,
        };
        if let Err(e) = run_kernel(opts, &archive, &cache, &rootfs, &readonly, &script, &mut result) {
            eprintln!("xtask: error: vm-test {s}: {e:#}");
            result.error = Some(format!("{e:#}"));
        }
        results.push(result);
    }

    eprintln!("==> vm-test: {} kernels in {:.0}s", results.len(), started.elapsed().as_secs_f64());
    for r in &results {
        r.print_where();
    }
    for r in &results {
        println!("{}", r.line());
    }
    Ok(if results.iter().all(KernelResult::ok) { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// One kernel: fetch it, assemble the initrd, boot, read the results.
fn run_kernel(
    opts: &Options,
    archive: &debian::Archive,
    cache: &Path,
    rootfs: &Path,
    readonly: &[PathBuf],
    script: &str,
    result: &mut KernelResult,
) -> Result<()> {
    let series = result.series.clone();
    let kernel = kernel::fetch(archive, &series, cache)?;
    result.release = Some(kernel.release.clone());
    let accel = match opts.accel {
        Some(a) => a,
        None => boot::probe(&kernel.vmlinuz, &kernel.release, cache)?,
    };
    result.accel = Some(accel);

    let out = &result.out;
    let _ = fs::remove_dir_all(out);
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    fs::write(out.join("run.sh"), suite::vm_env(accel, &series) + script)?;
    let initrd = out.join("initrd.cpio");
    initrd::assemble(rootfs, &kernel.modules_cpio, &initrd)?;

    let ro: Vec<String> = readonly.iter().map(|p| p.display().to_string()).collect();
    let mut shares: Vec<Share> = readonly
        .iter()
        .enumerate()
        .map(|(i, p)| Share { tag: format!("ro{i}"), path: p.clone(), readonly: true })
        .collect();
    shares.push(Share { tag: "out".into(), path: out.clone(), readonly: false });
    let vm = Vm {
        kernel: &kernel.vmlinuz,
        initrd: Some(&initrd),
        cmdline: format!(
            "console=ttyS0 quiet panic=-1 vmtest_ro={} vmtest_out={}",
            ro.join(","),
            out.display()
        ),
        shares,
        accel,
        cpus: opts.cpus,
        memory_mib: opts.memory,
    };
    eprintln!(
        "==> vm-test {series}: booting {} {} under {} ({} vCPUs, {} MiB)",
        kernel.package,
        kernel.version,
        accel.name().to_uppercase(),
        opts.cpus,
        opts.memory
    );
    let run = boot::run(
        &vm,
        &series,
        &out.join("console.log"),
        Duration::from_secs(opts.boot_timeout),
        Duration::from_secs(opts.timeout),
        false,
    );
    let _ = fs::remove_file(&initrd);
    let run = run?;
    eprintln!(
        "==> vm-test {series}: {} ({}), booted in {}, {:.0}s in all",
        kernel.release,
        accel.name(),
        run.boot.map_or("-".into(), |b| format!("{:.1}s", b.as_secs_f64())),
        run.elapsed.as_secs_f64()
    );
    result.summary = report::summarize(out);
    result.verifier = report::keep_verifier_output(out);
    result.run = Some(run);
    Ok(())
}

/// The series `--kernel` names, in order, `all` expanded.
fn selected_series(wanted: &[String]) -> Result<Vec<String>> {
    let mut out: Vec<String> = Vec::new();
    for w in wanted {
        let add: Vec<String> = if w == "all" {
            kernel::SERIES.iter().map(|(s, _)| s.to_string()).collect()
        } else {
            kernel::suite_of(w)?;
            vec![w.clone()]
        };
        for s in add {
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    Ok(out)
}

/// `${XDG_CACHE_HOME:-~/.cache}/ebpf-proxy/vm`, beside ./x's bpf-linker.
fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cache"))
        .join("ebpf-proxy/vm")
}

/// Cargo's target directory (absolute).
fn target_dir() -> Result<PathBuf> {
    let agent = agent_bin(false);
    // <target>/debug/ebpf-proxy
    let target = agent.parent().and_then(Path::parent).context("agent path has no target directory")?;
    fs::canonicalize(target).with_context(|| format!("resolving {}", target.display()))
}
