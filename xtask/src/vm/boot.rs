//! Running a kernel under QEMU: the command line, the choice between KVM
//! and TCG, and watching the serial console until the VM is done.
//!
//! The console is streamed to our stdout with a `[<series>] ` prefix and
//! saved whole. Markers printed by `init.sh` tell how far the VM got:
//! `vm-test: init` (booted) and `vm-test: done rc=N` (finished). QEMU is
//! killed when a deadline passes, and on drop, so none outlives us.

use std::{
    fs,
    io::{BufRead as _, BufReader, Read, Write as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// A directory of the host, mounted inside at the same path.
pub struct Share {
    pub tag: String,
    pub path: PathBuf,
    pub readonly: bool,
}

pub struct Vm<'a> {
    pub kernel: &'a Path,
    pub initrd: Option<&'a Path>,
    pub cmdline: String,
    pub shares: Vec<Share>,
    pub accel: Accel,
    pub cpus: usize,
    pub memory_mib: u32,
}

impl Vm<'_> {
    fn command(&self) -> Command {
        let mut cmd = Command::new("qemu-system-x86_64");
        match self.accel {
            // Paravirtual nested KVM: the host's CPU model is the one it emulates best.
            Accel::Kvm => cmd.args(["-accel", "kvm", "-cpu", "host"]),
            Accel::Tcg => cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]),
        };
        cmd.args(["-machine", "q35", "-smp"])
            .arg(self.cpus.to_string())
            .arg("-m")
            .arg(self.memory_mib.to_string())
            .args(["-nodefaults", "-no-reboot", "-display", "none", "-serial", "stdio", "-nic", "none"])
            .arg("-kernel")
            .arg(self.kernel)
            .arg("-append")
            .arg(&self.cmdline);
        if let Some(initrd) = self.initrd {
            cmd.arg("-initrd").arg(initrd);
        }
        for s in &self.shares {
            let mut spec = format!("local,path={},mount_tag={},security_model=none", s.path.display(), s.tag);
            if s.readonly {
                spec.push_str(",readonly=on");
            }
            cmd.arg("-virtfs").arg(spec);
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        cmd
    }
}

/// How a run ended.
#[derive(Debug)]
pub enum Outcome {
    /// `init.sh` finished; `rc` is what it reported ("0", "1", "init-failed").
    Finished { rc: String },
    /// No `vm-test: init` line before the boot deadline.
    NoBoot { after: Duration },
    /// Booted, but not done before the deadline.
    Timeout { after: Duration },
    /// QEMU ended before `init.sh` said it was done.
    Exited { status: String },
}

pub struct Run {
    pub outcome: Outcome,
    /// From QEMU's start to the `vm-test: init` line.
    pub boot: Option<Duration>,
    pub elapsed: Duration,
}

/// Kills QEMU unless it has already exited.
struct Qemu(Child);

impl Drop for Qemu {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

enum Event {
    Console(String),
    Stderr(String),
    Closed,
}

/// Boots `vm`, streams its console (prefixed with `label`, unless `quiet`)
/// and into `console_log`, and waits until it is done or a deadline passes.
pub fn run(vm: &Vm, label: &str, console_log: &Path, boot_timeout: Duration, timeout: Duration, quiet: bool) -> Result<Run> {
    let mut cmd = vm.command();
    let mut log = fs::File::create(console_log).with_context(|| format!("creating {}", console_log.display()))?;
    writeln!(log, "# {cmd:?}")?;
    let start = Instant::now();
    let mut qemu = Qemu(cmd.spawn().context("starting qemu-system-x86_64 (package qemu-system-x86)")?);
    let (tx, rx) = mpsc::channel();
    let stdout = qemu.0.stdout.take().unwrap();
    let stderr = qemu.0.stderr.take().unwrap();
    spawn_lines(stdout, tx.clone(), Event::Console);
    spawn_lines(stderr, tx, Event::Stderr);

    let mut boot = None;
    let mut open = 2;
    let mut outcome = None;
    // After the done line, QEMU gets this long to power off by itself.
    let mut done_at: Option<Duration> = None;
    while open > 0 {
        let now = start.elapsed();
        let wait = match done_at {
            Some(at) => (at + Duration::from_secs(20)).saturating_sub(now),
            None => {
                let deadline = if boot.is_some() { timeout } else { boot_timeout };
                if now >= deadline {
                    outcome = Some(match boot {
                        None => Outcome::NoBoot { after: boot_timeout },
                        Some(_) => Outcome::Timeout { after: timeout },
                    });
                    break;
                }
                deadline - now
            }
        };
        let event = match rx.recv_timeout(wait) {
            Ok(e) => e,
            Err(mpsc::RecvTimeoutError::Timeout) if done_at.is_some() => break,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let line = match event {
            Event::Closed => {
                open -= 1;
                continue;
            }
            Event::Console(l) => l,
            Event::Stderr(l) => format!("qemu: {l}"),
        };
        writeln!(log, "{line}")?;
        if !quiet {
            println!("[{label}] {line}");
        }
        if boot.is_none() && line.starts_with("vm-test: init") {
            boot = Some(start.elapsed());
        }
        // A nested KVM that cannot run this kernel stops the VM and leaves QEMU waiting.
        if line.starts_with("qemu: KVM internal error") {
            outcome = Some(Outcome::Exited { status: line });
            break;
        }
        if let Some(rc) = line.strip_prefix("vm-test: done rc=") {
            outcome = Some(Outcome::Finished { rc: rc.trim().to_string() });
            done_at = Some(start.elapsed());
        }
    }
    drop(rx);
    let outcome = match outcome {
        Some(o) => o,
        None => {
            let status = qemu.0.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
            Outcome::Exited { status }
        }
    };
    drop(qemu);
    Ok(Run { outcome, boot, elapsed: start.elapsed() })
}

fn spawn_lines(input: impl Read + Send + 'static, tx: mpsc::Sender<Event>, wrap: fn(String) -> Event) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(input);
        let mut buf = Vec::new();
        while matches!(reader.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
            let line = String::from_utf8_lossy(&buf);
            let line = line.trim_end_matches(['\n', '\r']).replace('\r', "");
            if tx.send(wrap(line)).is_err() {
                return;
            }
            buf.clear();
        }
        let _ = tx.send(Event::Closed);
    });
}

/// KVM if a short boot of `kernel` (no initrd: it must reach the panic for
/// a missing root) works under it, else TCG. The answer is cached per
/// kernel and host kernel in `cache/accel/`.
pub fn probe(kernel: &Path, release: &str, cache: &Path) -> Result<Accel> {
    if fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_err() {
        return Ok(Accel::Tcg);
    }
    let host = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let file = cache.join("accel").join(release);
    if let Ok(text) = fs::read_to_string(&file) {
        if let Some((accel, on)) = text.trim().split_once(' ') {
            if on == host.trim() {
                return Ok(if accel == "kvm" { Accel::Kvm } else { Accel::Tcg });
            }
        }
    }
    eprintln!("==> vm-test: probing KVM with {release} (a 30 s boot at most)");
    let vm = Vm {
        kernel,
        initrd: None,
        cmdline: "console=ttyS0 panic=-1".into(),
        shares: vec![],
        accel: Accel::Kvm,
        cpus: 1,
        memory_mib: 512,
    };
    fs::create_dir_all(file.parent().unwrap())?;
    // Not with_extension: a release has dots of its own.
    let log = file.with_file_name(format!("{release}.probe.log"));
    let run = run(&vm, release, &log, Duration::from_secs(30), Duration::from_secs(30), true)?;
    let console = fs::read_to_string(&log).unwrap_or_default();
    // Reaching the root-fs panic means the kernel booted all the way.
    let ok = console.contains("Unable to mount root fs") || console.contains("VFS: Cannot open root device");
    let accel = if ok { Accel::Kvm } else { Accel::Tcg };
    if !ok {
        let why = console
            .lines()
            .find(|l| l.starts_with("qemu: "))
            .map(|l| l.trim_start_matches("qemu: ").to_string())
            .unwrap_or_else(|| format!("{:?}", run.outcome));
        eprintln!("==> vm-test: KVM does not run {release} here ({why}); using TCG");
    }
    fs::write(&file, format!("{} {}\n", accel.name(), host.trim()))?;
    Ok(accel)
}
