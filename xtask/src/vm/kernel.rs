//! Debian's own kernels, by package name: the newest generic
//! `linux-image-<series>.*-amd64` of the suite that ships each series. The
//! generic flavour, because it has the 9p modules the VM mounts the
//! workspace with (`-cloud-amd64` has none).
//!
//! What the VM needs of a kernel package is kept in the cache: `vmlinuz`
//! and a cpio archive with the modules of [`MODULES`] and their
//! dependencies (from the package's own `modules.dep`), plus the
//! `modules.*` indexes so that `modprobe` works inside.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use super::{
    debian::{Archive, Package, depends, version_gt},
    initrd,
};
use crate::image::sha256_hex;

/// The kernel series vm-test knows, and the suite whose kernel each is.
pub const SERIES: [(&str, &str); 4] = [("5.10", "bullseye"), ("6.1", "bookworm"), ("6.12", "trixie"), ("7.2", "sid")];

/// Loaded at boot: 9p for the shared workspace, and what the tests use
/// (veth, the conformance cluster's bridge, clsact and tc BPF filters for
/// kernels without TCX, tun for the L3 devices). Built-in ones are skipped.
pub const MODULES: &[&str] =
    &["virtio_pci", "9pnet_virtio", "9p", "veth", "bridge", "sch_ingress", "cls_bpf", "act_bpf", "overlay", "tun"];

/// In the initrd, but loaded only after the tests, to show they load: the
/// tests that craft SCTP packets expect no kernel SCTP stack (which would
/// answer their INIT with an ABORT), as on a host without the module, and
/// sctp cannot be unloaded once loaded. A test that opens a real SCTP
/// socket has the kernel load it on demand (modprobe and the file are there).
pub const PROBED_MODULES: &[&str] = &["sctp"];

/// Loaded first where the kernel has them as modules: until 6.14, SCTP's
/// libcrc32c finds its CRC32c through the crypto API (a soft dependency
/// modprobe cannot follow without them), and fails with ENOENT otherwise.
pub const OPTIONAL_MODULES: &[&str] = &["crc32c_generic", "crc32c_intel"];

pub struct Kernel {
    /// `uname -r` inside the VM, e.g. "6.12.117+deb13-amd64".
    pub release: String,
    /// The linux-image package and its version.
    pub package: String,
    pub version: String,
    pub vmlinuz: PathBuf,
    /// `usr/lib/modules/<release>/...` and `etc/vm-test/modules`, as cpio.
    pub modules_cpio: PathBuf,
}

/// The suite that ships `series`.
pub fn suite_of(series: &str) -> Result<&'static str> {
    SERIES.iter().find(|(s, _)| *s == series).map(|(_, suite)| *suite).with_context(|| {
        format!("unknown kernel {series}; one of {}", SERIES.map(|(s, _)| s).join(", "))
    })
}

/// Resolves, downloads and unpacks the newest kernel of `series` (cached
/// under `cache/kernel/<release>_<version>/`).
pub fn fetch(archive: &Archive, series: &str, cache: &Path) -> Result<Kernel> {
    let suite = suite_of(series)?;
    let index = archive.packages(suite)?;
    let mut newest: Option<&Package> = None;
    for (name, versions) in &index {
        let Some(release) = name.strip_prefix("linux-image-") else { continue };
        let generic = release.ends_with("-amd64") && !release.ends_with("-cloud-amd64") && !release.ends_with("-rt-amd64");
        if !generic || !release.starts_with(&format!("{series}.")) {
            continue;
        }
        for p in versions {
            if newest.is_none_or(|n| version_gt(&p.version, &n.version).unwrap_or(false)) {
                newest = Some(p);
            }
        }
    }
    let image = newest.with_context(|| format!("no linux-image-{series}.*-amd64 in {suite}"))?;
    let release = image.name.strip_prefix("linux-image-").unwrap().to_string();

    // Since 7.x the image package is a shell: the kernel is in
    // linux-binary-<release>, the modules in linux-modules-<release> and
    // modules.builtin in linux-base-<release>.
    let mut debs = vec![image.clone()];
    for dep in depends(&image.depends) {
        if ["binary", "modules", "base"].iter().any(|part| dep == format!("linux-{part}-{release}")) {
            let p = index.get(dep).and_then(|v| v.iter().find(|p| p.version == image.version));
            debs.push(p.with_context(|| format!("{} needs {dep} {}, not in {suite}", image.name, image.version))?.clone());
        }
    }

    let dir = cache.join("kernel").join(format!("{release}_{}", image.version));
    let key = sha256_hex(format!("{OPTIONAL_MODULES:?} {MODULES:?} {PROBED_MODULES:?} {}", initrd::FORMAT).as_bytes());
    let kernel = Kernel {
        release: release.clone(),
        package: image.name.clone(),
        version: image.version.clone(),
        vmlinuz: dir.join("vmlinuz"),
        modules_cpio: dir.join("modules.cpio"),
    };
    if fs::read_to_string(dir.join("key")).is_ok_and(|k| k == key) {
        return Ok(kernel);
    }

    let files: Vec<PathBuf> = debs.iter().map(|p| archive.download(p)).collect::<Result<_>>()?;
    eprintln!("==> vm-test: unpacking {} {}", image.name, image.version);
    fs::create_dir_all(cache.join("kernel"))?;
    let unpacked = tempfile::tempdir_in(cache.join("kernel"))?;
    for deb in &files {
        let status = Command::new("dpkg-deb").arg("-x").arg(deb).arg(unpacked.path()).status().context("running dpkg-deb")?;
        if !status.success() {
            bail!("dpkg-deb -x {} failed ({status})", deb.display());
        }
    }
    let root = unpacked.path();
    let moddir = ["lib/modules", "usr/lib/modules"]
        .iter()
        .map(|d| root.join(d).join(&release))
        .find(|d| d.join("modules.builtin").exists())
        .with_context(|| format!("no modules/{release}/ in {}", image.name))?;
    depmod(root, &moddir, &release)?;
    let vmlinuz = [root.join(format!("boot/vmlinuz-{release}")), moddir.join("vmlinuz")]
        .into_iter()
        .find(|p| p.exists())
        .with_context(|| format!("no vmlinuz in {}", image.name))?;

    let stage = tempfile::tempdir_in(cache.join("kernel"))?;
    let target = stage.path().join("usr/lib/modules").join(&release);
    fs::create_dir_all(&target)?;
    for e in fs::read_dir(&moddir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("modules.") {
            fs::copy(e.path(), target.join(&name))?;
        }
    }
    let (files, load, probe) = needed_modules(&moddir)?;
    for rel in files {
        let to = target.join(&rel);
        fs::create_dir_all(to.parent().unwrap())?;
        fs::copy(moddir.join(&rel), &to).with_context(|| format!("copying {rel}"))?;
    }
    fs::create_dir_all(stage.path().join("etc/vm-test"))?;
    fs::write(stage.path().join("etc/vm-test/modules"), load.join("\n") + "\n")?;
    fs::write(stage.path().join("etc/vm-test/probe-modules"), probe.join("\n") + "\n")?;

    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    fs::copy(&vmlinuz, &kernel.vmlinuz)?;
    initrd::cpio(stage.path(), &kernel.modules_cpio)?;
    fs::write(dir.join("key"), key)?;
    Ok(kernel)
}

/// Writes `modules.dep` and the other indexes, which the packages leave to
/// depmod at install time. This depmod looks in `<root>/lib/modules`.
fn depmod(root: &Path, moddir: &Path, release: &str) -> Result<()> {
    let lib = root.join("lib/modules");
    if !lib.join(release).exists() {
        fs::create_dir_all(&lib)?;
        std::os::unix::fs::symlink(moddir, lib.join(release))?;
    }
    let status = Command::new("depmod")
        .arg("-b")
        .arg(root)
        .arg(release)
        .status()
        .context("running depmod (package kmod)")?;
    if !status.success() {
        bail!("depmod -b {} {release} failed ({status})", root.display());
    }
    Ok(())
}

/// The module files (relative to the modules directory) that
/// [`OPTIONAL_MODULES`], [`MODULES`], [`PROBED_MODULES`] and their
/// dependencies take, from `modules.dep`; the names to load in order, and
/// those to probe. Built-in modules need no file; a missing optional one
/// is left out, a missing other is an error.
fn needed_modules(moddir: &Path) -> Result<(BTreeSet<String>, Vec<String>, Vec<String>)> {
    let dep = fs::read_to_string(moddir.join("modules.dep"))?;
    let builtin = fs::read_to_string(moddir.join("modules.builtin")).unwrap_or_default();
    let name_of = |path: &str| -> String {
        let file = path.rsplit('/').next().unwrap_or(path);
        file.split(".ko").next().unwrap_or(file).replace('-', "_")
    };
    let entries: Vec<(String, String, Vec<String>)> = dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(m, deps)| (name_of(m), m.to_string(), deps.split_whitespace().map(String::from).collect()))
        .collect();
    let is_builtin = |name: &str| builtin.lines().any(|l| name_of(l) == name);

    let mut files = BTreeSet::new();
    let (mut load, mut probe) = (Vec::new(), Vec::new());
    let mut todo: Vec<String> = Vec::new();
    let wanted = OPTIONAL_MODULES
        .iter()
        .map(|m| (m, true, false))
        .chain(MODULES.iter().map(|m| (m, false, false)))
        .chain(PROBED_MODULES.iter().map(|m| (m, false, true)));
    for (w, optional, probed) in wanted {
        let w = w.replace('-', "_");
        match entries.iter().find(|(n, ..)| *n == w) {
            Some((_, path, _)) => {
                todo.push(path.clone());
                if probed { &mut probe } else { &mut load }.push(w);
            }
            None if is_builtin(&w) || optional => {}
            None => bail!("module {w} is neither in modules.dep nor built in"),
        }
    }
    while let Some(path) = todo.pop() {
        if files.insert(path.clone()) {
            if let Some((.., deps)) = entries.iter().find(|(_, p, _)| *p == path) {
                todo.extend(deps.iter().cloned());
            }
        }
    }
    Ok((files, load, probe))
}
