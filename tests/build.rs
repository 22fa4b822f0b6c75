use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

/// Builds proxy-ebpf with its `unit` feature for the BPF target: the BPF
/// unit tests' object, `bpf_unit` (src/bpf_unit.rs), which
/// `proxy_tests::bpf_unit` embeds with
/// `include_bytes_aligned!(concat!(env!("OUT_DIR"), "/bpf_unit"))`. The
/// agent's object comes from proxy-user's build, without the feature.
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
        features: &["unit"],
        ..Default::default()
    };
    // The same pinned nightly as the rest of the workspace (see proxy-user/build.rs).
    println!("cargo:rerun-if-env-changed=RUSTUP_TOOLCHAIN");
    let toolchain = std::env::var("RUSTUP_TOOLCHAIN").ok();
    let toolchain = match toolchain.as_deref() {
        Some(name) => Toolchain::Custom(name),
        None => Toolchain::default(),
    };
    aya_build::build_ebpf([package], toolchain)
}
