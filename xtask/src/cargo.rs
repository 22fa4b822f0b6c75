//! Running cargo and finding what it built.

use std::{
    path::{Path, PathBuf},
    process::Command,
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

/// Runs `cmd` and fails unless it exits successfully.
pub fn run(mut cmd: Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
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
