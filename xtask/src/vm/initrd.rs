//! The VM's initramfs, which is its whole root filesystem: Linux unpacks
//! concatenated cpio archives one after the other, so the initrd is the
//! cached userland ([`super::rootfs`]), the kernel's modules
//! ([`super::kernel`]) and `/init` ([`INIT`]), glued together per run.
//! Uncompressed: under TCG, unpacking a compressed archive costs more than
//! reading a bigger one.

use std::{fs, io, os::unix::fs::PermissionsExt as _, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};

/// PID 1 of the VM.
pub const INIT: &str = include_str!("init.sh");

/// Changes whenever the layout of the cached archives does, so old caches
/// are rebuilt rather than misread.
pub const FORMAT: &str = "vm-test initrd v1: usr/lib/modules, etc/vm-test/modules";

/// Writes the contents of `dir` (not `dir` itself, whose mode would become
/// that of `/`) as a newc cpio archive to `out`, owners and modes kept.
pub fn cpio(dir: &Path, out: &Path) -> Result<()> {
    let tmp = out.with_extension("part");
    let file = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let status = Command::new("sh")
        .args(["-c", r#"cd "$1" && find . -mindepth 1 -print0 | LC_ALL=C sort -z | cpio --null --create --format=newc --quiet"#, "sh"])
        .arg(dir)
        .stdout(file)
        .status()
        .context("running find | cpio (package cpio)")?;
    if !status.success() {
        let _ = fs::remove_file(&tmp);
        bail!("cpio of {} failed ({status})", dir.display());
    }
    fs::rename(&tmp, out)?;
    Ok(())
}

/// `rootfs` + `modules` + an archive holding only `/init`, into `out`.
pub fn assemble(rootfs: &Path, modules: &Path, out: &Path) -> Result<()> {
    let stage = tempfile::tempdir_in(out.parent().context("initrd path has no parent")?)?;
    let init_dir = stage.path().join("init");
    fs::create_dir(&init_dir)?;
    let init = init_dir.join("init");
    fs::write(&init, INIT)?;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755))?;
    let init_cpio = stage.path().join("init.cpio");
    cpio(&init_dir, &init_cpio)?;

    let mut initrd = fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    for part in [rootfs, modules, &init_cpio] {
        io::copy(&mut fs::File::open(part).with_context(|| format!("opening {}", part.display()))?, &mut initrd)?;
    }
    Ok(())
}
