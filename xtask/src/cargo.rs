//! Running cargo and finding what it built.

use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// The workspace root (the parent of xtask/).
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
}

/// `cargo` (the one that started us), run from the workspace root.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

/// Runs `cmd` (a cargo command) and fails unless it exits successfully.
/// Its stderr passes through as it comes; a failure's message repeats
/// cargo's own `error` lines, and the free space where it builds, so that
/// the one line a CI log ends with names the cause.
pub fn run(mut cmd: Command) -> Result<()> {
    let mut child = cmd.stderr(Stdio::piped()).spawn().with_context(|| format!("running {cmd:?}"))?;
    let mut errors = ErrorLines::default();
    tee_lines(child.stderr.take().expect("piped"), std::io::stderr(), |line| errors.add(line))?;
    let status = child.wait()?;
    if !status.success() {
        bail!(
            "{cmd:?} failed ({status}); free on the target disk: {}; its errors: {}",
            free_space(&workspace_root().join("target")),
            if errors.lines.is_empty() { "none printed".to_string() } else { errors.lines.join(" | ") },
        );
    }
    Ok(())
}

/// Cargo's `error` lines and the notes under them (a linker's reason
/// comes as a note), not its warnings': enough to name a cause, not a page.
#[derive(Default)]
struct ErrorLines {
    lines: Vec<String>,
    in_error: bool,
}

impl ErrorLines {
    const MAX: usize = 12;

    fn add(&mut self, line: &str) {
        // Without colour codes (cargo colours when it sees a terminal, or
        // when told to).
        let plain = anstream::adapter::strip_str(line).to_string();
        let plain = plain.trim();
        let is_error = plain.starts_with("error");
        if is_error {
            self.in_error = true;
        } else if plain.starts_with("warning") {
            self.in_error = false;
        }
        let wanted = is_error || (self.in_error && plain.starts_with("= note:"));
        if wanted && self.lines.len() < Self::MAX {
            self.lines.push(plain.chars().take(300).collect());
        }
    }
}

/// Copies `input` to `output` as it arrives and hands each line to `f`.
pub fn tee_lines(mut input: impl Read, mut output: impl Write, mut f: impl FnMut(&str)) -> Result<()> {
    let (mut buf, mut line) = ([0u8; 8192], Vec::new());
    loop {
        let n = input.read(&mut buf)?;
        if n == 0 {
            break;
        }
        output.write_all(&buf[..n])?;
        output.flush()?;
        for &b in &buf[..n] {
            if b == b'\n' {
                f(&String::from_utf8_lossy(&line));
                line.clear();
            } else {
                line.push(b);
            }
        }
    }
    f(&String::from_utf8_lossy(&line));
    Ok(())
}

/// What `df` says is free on `dir`'s filesystem (or its parent's, before
/// the first build made it), for a failed build's message.
fn free_space(dir: &Path) -> String {
    let dir = if dir.exists() { dir } else { workspace_root() };
    Command::new("df")
        .args(["--output=avail", "-h"])
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().nth(1).map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "unknown".to_string())
}

/// Absolute path of the `ebpf-proxy` binary of a debug or release build.
pub fn agent_bin(release: bool) -> PathBuf {
    let target = ["CARGO_TARGET_DIR", "CARGO_BUILD_TARGET_DIR"]
        .iter()
        .find_map(std::env::var_os)
        .map(PathBuf::from)
        .unwrap_or_else(|| "target".into());
    workspace_root()
        .join(target)
        .join(if release { "release" } else { "debug" })
        .join("ebpf-proxy")
}

/// Builds the agent (`cargo build -p proxy-user`) and returns its path.
pub fn build_agent(release: bool) -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.args(["build", "-p", "proxy-user"]);
    if release {
        cmd.arg("--release");
    }
    run(cmd)?;
    existing(agent_bin(release))
}

/// `path` if it exists, else an error naming it.
pub fn existing(path: PathBuf) -> Result<PathBuf> {
    if !path.exists() {
        bail!("{} not found after the build", path.display());
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors and their notes are kept, colours taken off; warnings and
    /// their notes are not.
    #[test]
    fn error_lines_keep_errors_and_their_notes_only() {
        let mut e = ErrorLines::default();
        for line in [
            "\x1b[1m\x1b[33mwarning\x1b[0m: unused variable",
            "  = note: `#[warn(unused_variables)]` on by default",
            "   Compiling proxy-user v0.1.0",
            "\x1b[1m\x1b[31merror\x1b[0m: linking with `cc` failed: exit status: 1",
            "  |",
            "  = note: /usr/bin/ld: final link failed: No space left on device",
            "error: could not compile `proxy-user` (bin \"ebpf-proxy\") due to 1 previous error",
        ] {
            e.add(line);
        }
        assert_eq!(
            e.lines,
            [
                "error: linking with `cc` failed: exit status: 1",
                "= note: /usr/bin/ld: final link failed: No space left on device",
                "error: could not compile `proxy-user` (bin \"ebpf-proxy\") due to 1 previous error",
            ]
        );
    }
}
