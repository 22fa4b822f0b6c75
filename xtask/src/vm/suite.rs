//! What runs inside the VM: the test binaries `cargo test --workspace`
//! would run (as `cargo test --no-run --message-format=json` lists them),
//! written out as the shell script `init.sh` starts.

use std::{
    io::BufReader,
    path::{Path, PathBuf},
    process::Stdio,
};

use anyhow::{Context as _, Result, bail};
use cargo_metadata::Message;

use crate::cargo::cargo;

/// Environment variables passed into the VM (a trailing `_`: a prefix).
const FORWARDED: &[&str] = &["RUST_LOG", "RUST_BACKTRACE", "CONFORMANCE_"];

/// What the tests need to know of the VM they run in: SCTP sockets must work
/// there (Debian's kernels have the module, so the kernel-socket test may not
/// skip), and under TCG their deadlines stretch (the same work runs several
/// times slower; see proxy_tests::patience). 5.10's verifier prunes less
/// than later ones': under TCG it takes ~40 s over the agent's programs
/// (6.1: ~10 s), near a 10 s deadline times 5, so it gets twice that.
pub fn vm_env(accel: super::boot::Accel, series: &str) -> String {
    let patience = match (accel, series) {
        (super::boot::Accel::Tcg, "5.10") => 10,
        (super::boot::Accel::Tcg, _) => 5,
        _ => 1,
    };
    format!("export EBPF_PROXY_REQUIRE_SCTP=1 EBPF_PROXY_TEST_PATIENCE={patience}\n")
}

/// One test executable and where cargo would run it from.
pub struct TestBinary {
    /// The target's name: the file name under tests/ for integration
    /// tests, the crate's for unit tests.
    pub name: String,
    pub exe: PathBuf,
    /// The package's directory (cargo test's working directory).
    pub cwd: PathBuf,
}

/// Builds the test binaries and returns those selected by `only` (target
/// names; empty: all). An unknown name is an error that lists the known.
pub fn build(only: &[String]) -> Result<Vec<TestBinary>> {
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--no-run", "--message-format=json-render-diagnostics"])
        .stdout(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("running {cmd:?}"))?;
    let mut all = Vec::new();
    for msg in Message::parse_stream(BufReader::new(child.stdout.take().unwrap())) {
        if let Message::CompilerArtifact(a) = msg? {
            if let (true, Some(exe)) = (a.profile.test, a.executable) {
                all.push(TestBinary {
                    name: a.target.name.clone(),
                    exe: exe.into(),
                    cwd: a.manifest_path.parent().context("manifest path has no parent")?.into(),
                });
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    all.sort_by(|a, b| a.name.cmp(&b.name));
    if only.is_empty() {
        return Ok(all);
    }
    for name in only {
        if !all.iter().any(|t| &t.name == name) {
            let known: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
            bail!("no test binary named {name}; there are: {}", known.join(", "));
        }
    }
    Ok(all.into_iter().filter(|t| only.contains(&t.name)).collect())
}

/// The script that runs `tests` one after the other, each with `args`, as
/// `xtask test` runs them on the host (EBPF_PROXY_BIN set, and
/// EBPF_PROXY_KAPISRV_BIN where kapisrv was built), and exits 1 if any failed.
pub fn script(tests: &[TestBinary], agent: &Path, kapisrv: Option<&Path>, args: &[String]) -> String {
    let mut s = String::from("# Written by `cargo xtask vm-test`; run by init.sh inside the VM.\n");
    s += &format!("export EBPF_PROXY_BIN={}\n", quote(&agent.to_string_lossy()));
    if let Some(k) = kapisrv {
        s += &format!("export EBPF_PROXY_KAPISRV_BIN={}\n", quote(&k.to_string_lossy()));
    }
    // The knobs the tests read from the environment go along.
    for (k, v) in std::env::vars() {
        if FORWARDED.iter().any(|f| k == *f || (f.ends_with('_') && k.starts_with(f))) {
            s += &format!("export {k}={}\n", quote(&v));
        }
    }
    s += "rc=0\n";
    let args: Vec<String> = args.iter().map(|a| quote(a)).collect();
    for t in tests {
        s += &format!(
            "echo {}\n(cd {} && exec {} {}) || rc=1\n",
            quote(&format!("     Running {} ({})", t.name, t.exe.display())),
            quote(&t.cwd.to_string_lossy()),
            quote(&t.exe.to_string_lossy()),
            args.join(" "),
        );
    }
    s += "exit $rc\n";
    s
}

/// `s` as one shell word.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}
