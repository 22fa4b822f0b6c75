use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

/// Builds proxy-ebpf for the BPF target; the object is embedded in the agent
/// with `include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy"))`.
fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "proxy-ebpf")
        .ok_or_else(|| anyhow!("proxy-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", ebpf.manifest_path))?;
    let package = aya_build::Package {
        name: ebpf.name.as_str(),
        root_dir: root_dir.as_str(),
        ..Default::default()
    };
    // The BPF build uses the same pinned nightly as the rest of the workspace
    // (rust-toolchain.toml), which rustup names in RUSTUP_TOOLCHAIN.
    println!("cargo:rerun-if-env-changed=RUSTUP_TOOLCHAIN");
    let toolchain = std::env::var("RUSTUP_TOOLCHAIN").ok();
    let toolchain = match toolchain.as_deref() {
        Some(name) => Toolchain::Custom(name),
        None => Toolchain::default(),
    };
    aya_build::build_ebpf([package], toolchain)
}
