//! `xtask image`: an OCI image archive of the agent, built without a
//! container engine. The archive is an OCI image layout (`oci-layout`,
//! `index.json`, `blobs/sha256/...`) in one tar, which `skopeo copy
//! oci-archive:...`, `ctr images import` or `podman load` take as is.
//!
//! One layer holds `/usr/local/bin/ebpf-proxy` and the shared objects `ldd`
//! says it loads (the dynamic loader, libc, libm, libgcc_s), copied from the
//! build machine: the binary runs against the very glibc it was linked and
//! tested with, and no second (musl) build of the whole tree is needed.
//! Timestamps and owners are fixed, so the same binary gives the same digests.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context, Result, bail, ensure};
use flate2::{Compression, write::GzEncoder};
use oci_spec::image::{
    ANNOTATION_REF_NAME, Arch, ConfigBuilder, Descriptor, DescriptorBuilder, ImageConfigurationBuilder,
    ImageIndexBuilder, ImageManifestBuilder, MediaType, OciLayoutBuilder, Os, PlatformBuilder, RootFsBuilder,
    Sha256Digest,
};
use sha2::{Digest as _, Sha256};

/// Where the agent lives in the image (deploy/daemonset.yaml runs it from here).
pub const BINARY_IN_IMAGE: &str = "usr/local/bin/ebpf-proxy";

#[derive(clap::Args)]
pub struct Options {
    /// Put this binary in the image instead of building a release one.
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// Where to write the archive [default: target/ebpf-proxy-<version>.oci.tar].
    #[arg(long, value_name = "PATH")]
    output: Option<PathBuf>,
    /// The image reference recorded in the index [default: ebpf-proxy:<version>].
    #[arg(long, value_name = "NAME:TAG")]
    tag: Option<String>,
}

pub fn run(opts: &Options) -> Result<ExitCode> {
    let binary = match &opts.binary {
        Some(b) => b.clone(),
        None => crate::cargo::build_agent(true)?,
    };
    let version = env!("CARGO_PKG_VERSION");
    let output = opts
        .output
        .clone()
        .unwrap_or_else(|| crate::cargo::workspace_root().join(format!("target/ebpf-proxy-{version}.oci.tar")));
    let tag = opts.tag.clone().unwrap_or_else(|| format!("ebpf-proxy:{version}"));
    let manifest = build(&binary, &tag, &output)?;
    println!("{} ({tag}, manifest {manifest})", output.display());
    Ok(ExitCode::SUCCESS)
}

/// A content-addressed blob of the layout.
struct Blob {
    bytes: Vec<u8>,
    hex: String,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Blob {
        let hex = sha256_hex(&bytes);
        Blob { bytes, hex }
    }

    fn descriptor(&self, media_type: MediaType) -> Result<Descriptor> {
        Ok(Descriptor::new(media_type, self.bytes.len() as u64, self.hex.parse::<Sha256Digest>()?))
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the image archive for `binary` to `output`; returns the manifest digest.
pub fn build(binary: &Path, tag: &str, output: &Path) -> Result<String> {
    let binary = std::fs::canonicalize(binary).with_context(|| format!("--binary {}", binary.display()))?;
    let mut files = vec![(PathBuf::from(BINARY_IN_IMAGE), binary.clone())];
    for lib in shared_objects(&binary)? {
        let source = std::fs::canonicalize(&lib).with_context(|| format!("{} (listed by ldd)", lib.display()))?;
        files.push((lib.strip_prefix("/")?.to_path_buf(), source));
    }

    let layer_tar = layer(&files)?;
    let diff_id = format!("sha256:{}", sha256_hex(&layer_tar));
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&layer_tar)?;
    let layer = Blob::new(gz.finish()?);
    drop(layer_tar);

    let (arch, os) = (go_arch()?, Os::Linux);
    let config = ImageConfigurationBuilder::default()
        .architecture(arch.clone())
        .os(os.clone())
        .config(
            ConfigBuilder::default()
                .entrypoint(vec![format!("/{BINARY_IN_IMAGE}")])
                .cmd(vec!["run".to_string()])
                .build()?,
        )
        .rootfs(RootFsBuilder::default().typ("layers").diff_ids(vec![diff_id]).build()?)
        .build()?;
    let config = Blob::new(serde_json::to_vec(&config)?);
    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(config.descriptor(MediaType::ImageConfig)?)
        .layers(vec![layer.descriptor(MediaType::ImageLayerGzip)?])
        .build()?;
    let manifest = Blob::new(serde_json::to_vec(&manifest)?);
    let index = ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageIndex)
        .manifests(vec![
            DescriptorBuilder::default()
                .media_type(MediaType::ImageManifest)
                .size(manifest.bytes.len() as u64)
                .digest(manifest.hex.parse::<Sha256Digest>()?)
                .platform(PlatformBuilder::default().architecture(arch).os(os).build()?)
                .annotations([(ANNOTATION_REF_NAME.to_string(), tag.to_string())].into_iter().collect::<std::collections::HashMap<_, _>>())
                .build()?,
        ])
        .build()?;
    let layout = OciLayoutBuilder::default().image_layout_version("1.0.0").build()?;

    if let Some(dir) = output.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let file = std::fs::File::create(output).with_context(|| format!("create {}", output.display()))?;
    let mut archive = tar::Builder::new(std::io::BufWriter::new(file));
    append(&mut archive, "oci-layout", &serde_json::to_vec(&layout)?, 0o644)?;
    append(&mut archive, "index.json", &serde_json::to_vec(&index)?, 0o644)?;
    for dir in ["blobs/", "blobs/sha256/"] {
        append_dir(&mut archive, dir)?;
    }
    for blob in [&layer, &config, &manifest] {
        append(&mut archive, &format!("blobs/sha256/{}", blob.hex), &blob.bytes, 0o644)?;
    }
    archive.into_inner()?.flush()?;
    Ok(format!("sha256:{}", manifest.hex))
}

/// The shared objects the dynamic loader maps for `binary`, by the paths it
/// looks them up under (those are the paths the image must have).
fn shared_objects(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(binary).output().context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let why = String::from_utf8_lossy(&out.stderr);
        ensure!(why.contains("not a dynamic executable"), "ldd {}: {why}", binary.display());
        return Ok(Vec::new()); // static: nothing else to ship
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", "/lib64/ld-linux-x86-64.so.2 (0x...)",
        // "linux-vdso.so.1 (0x...)" (in the kernel, nothing to ship), "libfoo.so => not found".
        let line = line.trim();
        if line.contains("not found") {
            bail!("ldd {}: {line}", binary.display());
        }
        let path = match line.split_once(" => ") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next().filter(|p| p.starts_with('/')),
        };
        if let Some(p) = path {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

fn go_arch() -> Result<Arch> {
    Ok(match std::env::consts::ARCH {
        "x86_64" => Arch::Amd64,
        "aarch64" => Arch::ARM64,
        other => bail!("no OCI architecture name for {other}"),
    })
}

/// The root filesystem: each file under its image path, with its parent
/// directories, all owned by root and dated at the epoch.
fn layer(files: &[(PathBuf, PathBuf)]) -> Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for (in_image, _) in files {
        for dir in in_image.ancestors().skip(1).filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(format!("{}/", dir.display()));
        }
    }
    for dir in &dirs {
        append_dir(&mut tar, dir)?;
    }
    for (in_image, source) in files {
        let bytes = std::fs::read(source).with_context(|| format!("read {}", source.display()))?;
        append(&mut tar, in_image.to_str().context("non-UTF-8 path")?, &bytes, 0o755)?;
    }
    Ok(tar.into_inner()?)
}

fn header(entry: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(entry);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

fn append<W: Write>(tar: &mut tar::Builder<W>, path: &str, bytes: &[u8], mode: u32) -> Result<()> {
    let mut h = header(tar::EntryType::Regular, bytes.len() as u64, mode);
    tar.append_data(&mut h, path, bytes).with_context(|| format!("add {path}"))?;
    Ok(())
}

fn append_dir<W: Write>(tar: &mut tar::Builder<W>, path: &str) -> Result<()> {
    let mut h = header(tar::EntryType::Directory, 0, 0o755);
    tar.append_data(&mut h, path, std::io::empty()).with_context(|| format!("add {path}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Builds the image from the agent binary under test, then reads it the
    //! way a runtime does: index -> manifest -> config and layers, every
    //! digest and size checked, layers unpacked into a root filesystem, and
    //! the binary run inside it with chroot.

    use std::{collections::BTreeMap, io::Read};

    use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};

    use super::*;

    /// `$EBPF_PROXY_BIN` (set by `cargo xtask test`) or the debug build.
    fn agent_bin() -> PathBuf {
        std::env::var_os("EBPF_PROXY_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::cargo::workspace_root().join("target/debug/ebpf-proxy"))
    }

    /// Every regular file of the archive, by path.
    fn read_archive(path: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
        let mut files = BTreeMap::new();
        let mut archive = tar::Archive::new(std::fs::File::open(path)?);
        for entry in archive.entries()? {
            let mut entry = entry?;
            if entry.header().entry_type().is_file() {
                let name = entry.path()?.to_string_lossy().into_owned();
                let mut bytes = Vec::new();
                entry.read_to_end(&mut bytes)?;
                files.insert(name, bytes);
            }
        }
        Ok(files)
    }

    /// The blob a descriptor points to, after checking its size and digest.
    fn blob<'a>(files: &'a BTreeMap<String, Vec<u8>>, d: &Descriptor) -> Result<&'a [u8]> {
        let hex = d.digest().digest();
        let bytes = files.get(&format!("blobs/sha256/{hex}")).with_context(|| format!("no blob {hex}"))?;
        ensure!(bytes.len() as u64 == d.size(), "blob {hex}: {} bytes, descriptor says {}", bytes.len(), d.size());
        ensure!(sha256_hex(bytes) == hex, "blob {hex}: content does not match its digest");
        Ok(bytes)
    }

    /// Runs `args` inside `root` with an empty environment, so nothing of
    /// the host (PATH, LD_LIBRARY_PATH) helps the binary find its libraries.
    fn chroot(root: &Path, args: &[&str]) -> Result<std::process::Output> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let chroot = std::env::split_paths(&path)
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|d| d.join("chroot"))
            .find(|p| p.exists())
            .context("no chroot command")?;
        Ok(Command::new(chroot).arg(root).args(args).env_clear().output()?)
    }

    #[test]
    fn image_unpacks_by_digest_and_the_agent_runs_inside() -> Result<()> {
        let work = tempfile::tempdir()?;
        let archive = work.path().join("image.oci.tar");
        let manifest_digest = build(&agent_bin(), "ebpf-proxy:test", &archive)?;
        let files = read_archive(&archive)?;

        let layout: serde_json::Value = serde_json::from_slice(&files["oci-layout"])?;
        assert_eq!(layout["imageLayoutVersion"], "1.0.0");
        let index: ImageIndex = serde_json::from_slice(&files["index.json"])?;
        let [m] = index.manifests().as_slice() else { bail!("one manifest expected: {index:?}") };
        assert_eq!(m.digest().to_string(), manifest_digest);
        assert_eq!(m.annotations().as_ref().and_then(|a| a.get(ANNOTATION_REF_NAME)).map(String::as_str), Some("ebpf-proxy:test"));
        let manifest: ImageManifest = serde_json::from_slice(blob(&files, m)?)?;
        let config: ImageConfiguration = serde_json::from_slice(blob(&files, manifest.config())?)?;
        assert_eq!(config.os(), &Os::Linux);
        assert_eq!(manifest.layers().len(), config.rootfs().diff_ids().len());

        let rootfs = work.path().join("rootfs");
        std::fs::create_dir(&rootfs)?;
        for (layer, diff_id) in manifest.layers().iter().zip(config.rootfs().diff_ids()) {
            assert_eq!(layer.media_type(), &MediaType::ImageLayerGzip);
            let mut tar = Vec::new();
            flate2::read::GzDecoder::new(blob(&files, layer)?).read_to_end(&mut tar)?;
            assert_eq!(format!("sha256:{}", sha256_hex(&tar)), *diff_id, "diff_id of {}", layer.digest());
            tar::Archive::new(tar.as_slice()).unpack(&rootfs)?;
        }

        // The image's own entrypoint, with the arguments an operator would give.
        let entrypoint = config.config().as_ref().and_then(|c| c.entrypoint().clone()).context("no entrypoint")?;
        let run = |args: &[&str]| {
            let argv: Vec<&str> = entrypoint.iter().map(String::as_str).chain(args.iter().copied()).collect();
            chroot(&rootfs, &argv)
        };
        let out = run(&["--version"])?;
        assert!(out.status.success(), "--version in the image: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), format!("ebpf-proxy {}", env!("CARGO_PKG_VERSION")));

        let out = run(&["dump", "services", "--bpffs-root", "/nonexistent"])?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("no pinned map at /nonexistent/") && stderr.contains("--bpffs-root"), "{stderr}");
        Ok(())
    }

    #[test]
    fn same_binary_same_digests() -> Result<()> {
        // A small dynamic executable keeps this one cheap; the layer logic is the same.
        let work = tempfile::tempdir()?;
        let true_bin = which_true()?;
        let a = build(&true_bin, "t:1", &work.path().join("a.tar"))?;
        let b = build(&true_bin, "t:1", &work.path().join("b.tar"))?;
        assert_eq!(a, b, "building twice gave different manifests");
        assert_eq!(std::fs::read(work.path().join("a.tar"))?, std::fs::read(work.path().join("b.tar"))?);
        Ok(())
    }

    fn which_true() -> Result<PathBuf> {
        ["/usr/bin/true", "/bin/true"].iter().map(PathBuf::from).find(|p| p.exists()).context("no `true` binary")
    }
}
