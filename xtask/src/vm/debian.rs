//! Debian's archive as a package registry: the signed index of a suite and
//! the `.deb`s it names, fetched from the mirror apt uses on this machine
//! without touching apt's own state (no `apt-get update`, no lists).
//!
//! Trust runs the way apt's does: `InRelease` is checked with `gpgv` against
//! debian-archive-keyring, the `Packages` index against the SHA256 that
//! `InRelease` gives, and each `.deb` against the SHA256 in `Packages`.

use std::{
    collections::HashMap,
    fs,
    io::Read as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::image::sha256_hex;

const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";
const ARCH: &str = "amd64";

/// One stanza of a `Packages` index (the fields we read).
#[derive(Clone, Debug)]
pub struct Package {
    pub name: String,
    pub version: String,
    pub depends: String,
    pub filename: String,
    pub sha256: String,
    pub size: u64,
}

/// A suite's `main` component for amd64, as read from a mirror.
pub struct Archive {
    mirror: String,
    cache: PathBuf,
}

impl Archive {
    /// The mirror apt uses here (`$EBPF_PROXY_DEBIAN_MIRROR` overrides it);
    /// downloads are kept under `cache`.
    pub fn new(cache: &Path) -> Result<Archive> {
        let mirror = match std::env::var("EBPF_PROXY_DEBIAN_MIRROR") {
            Ok(m) => m,
            Err(_) => apt_mirror()?.context(
                "no .../debian mirror in /etc/apt/sources.list{,.d}; set EBPF_PROXY_DEBIAN_MIRROR",
            )?,
        };
        fs::create_dir_all(cache.join("debs"))?;
        Ok(Archive { mirror: mirror.trim_end_matches('/').to_string(), cache: cache.to_path_buf() })
    }

    /// The mirror's base URL (`http://.../debian`).
    pub fn mirror(&self) -> &str {
        &self.mirror
    }

    /// Every package of `suite` (main, amd64), from a verified index. The
    /// index is cached by its hash, so an unchanged suite costs one small
    /// `InRelease` download.
    pub fn packages(&self, suite: &str) -> Result<HashMap<String, Vec<Package>>> {
        let release = self.get(&format!("dists/{suite}/InRelease"))?;
        let signed = self.cache.join(format!("InRelease-{suite}"));
        fs::write(&signed, &release)?;
        let out = Command::new("gpgv")
            .args(["--keyring", KEYRING])
            .arg(&signed)
            .output()
            .context("running gpgv (package gpgv) to check InRelease")?;
        if !out.status.success() {
            bail!("{suite} InRelease: bad signature:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        let path = format!("main/binary-{ARCH}/Packages.gz");
        let (sha, size) = String::from_utf8_lossy(&release)
            .lines()
            .skip_while(|l| !l.starts_with("SHA256:"))
            .skip(1)
            .take_while(|l| l.starts_with(' '))
            .find_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
                [sha, size, p] if p == path => Some((sha.to_string(), size.parse::<u64>().ok()?)),
                _ => None,
            })
            .with_context(|| format!("{suite} InRelease lists no SHA256 for {path}"))?;

        let cached = self.cache.join(format!("Packages-{suite}-{}.gz", &sha[..16]));
        let gz = match fs::read(&cached) {
            Ok(b) if sha256_hex(&b) == sha => b,
            _ => {
                eprintln!("==> vm-test: fetching the {suite} package index ({} MB)", size / 1_000_000);
                let b = self.get(&format!("dists/{suite}/{path}"))?;
                ensure!(sha256_hex(&b) == sha, "{suite} {path}: SHA256 differs from InRelease");
                remove_matching(&self.cache, &format!("Packages-{suite}-"));
                fs::write(&cached, &b)?;
                b
            }
        };
        let mut text = String::new();
        flate2::read::GzDecoder::new(&gz[..]).read_to_string(&mut text).context("unpacking Packages.gz")?;
        let mut by_name: HashMap<String, Vec<Package>> = HashMap::new();
        for stanza in text.split("\n\n") {
            if let Some(p) = parse_stanza(stanza) {
                by_name.entry(p.name.clone()).or_default().push(p);
            }
        }
        Ok(by_name)
    }

    /// The `.deb` of `pkg`, downloaded once and checked against its SHA256.
    pub fn download(&self, pkg: &Package) -> Result<PathBuf> {
        let file = pkg.filename.rsplit('/').next().unwrap();
        let path = self.cache.join("debs").join(file);
        if fs::metadata(&path).is_ok_and(|m| m.len() == pkg.size) {
            return Ok(path);
        }
        eprintln!("==> vm-test: fetching {} {} ({} MB)", pkg.name, pkg.version, pkg.size / 1_000_000);
        let bytes = self.get(&pkg.filename)?;
        ensure!(
            sha256_hex(&bytes) == pkg.sha256,
            "{}: SHA256 differs from the Packages index (corrupt download?)",
            pkg.filename
        );
        let tmp = path.with_extension("part");
        fs::write(&tmp, &bytes)?;
        fs::rename(&tmp, &path)?;
        Ok(path)
    }

    fn get(&self, rel: &str) -> Result<Vec<u8>> {
        let url = format!("{}/{rel}", self.mirror);
        let mut resp = ureq::get(&url).call().with_context(|| format!("GET {url}"))?;
        resp.body_mut()
            .with_config()
            .limit(1 << 30)
            .read_to_vec()
            .with_context(|| format!("reading {url}"))
    }
}

/// `dpkg --compare-versions a gt b`: Debian's version order is dpkg's to define.
pub fn version_gt(a: &str, b: &str) -> Result<bool> {
    let status = Command::new("dpkg").args(["--compare-versions", a, "gt", b]).status().context("running dpkg")?;
    Ok(status.success())
}

/// Package names in a `Depends:` field (alternatives and versions dropped).
pub fn depends(field: &str) -> impl Iterator<Item = &str> {
    field
        .split(',')
        .flat_map(|alt| alt.split('|'))
        .filter_map(|d| d.split_whitespace().next())
}

fn parse_stanza(stanza: &str) -> Option<Package> {
    let mut fields: HashMap<&str, &str> = HashMap::new();
    for line in stanza.lines() {
        if let Some((k, v)) = line.split_once(": ") {
            if !line.starts_with(' ') {
                fields.insert(k, v.trim());
            }
        }
    }
    Some(Package {
        name: fields.get("Package")?.to_string(),
        version: fields.get("Version")?.to_string(),
        depends: fields.get("Depends").unwrap_or(&"").to_string(),
        filename: fields.get("Filename")?.to_string(),
        sha256: fields.get("SHA256")?.to_string(),
        size: fields.get("Size")?.parse().ok()?,
    })
}

/// The first `.../debian` URI in apt's sources (one-line and deb822 forms).
fn apt_mirror() -> Result<Option<String>> {
    let mut uris = Vec::new();
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.filter_map(|e| Some(e.ok()?.path())).collect();
        more.sort();
        files.extend(more);
    }
    for file in files {
        let Ok(text) = fs::read_to_string(&file) else { continue };
        for line in text.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("URIs:") {
                uris.extend(rest.split_whitespace().map(String::from));
            } else if line.starts_with("deb ") {
                uris.extend(line.split_whitespace().find(|w| w.starts_with("http")).map(String::from));
            }
        }
    }
    Ok(uris.into_iter().map(|u| u.trim_end_matches('/').to_string()).find(|u| u.ends_with("/debian")))
}

/// Removes the files in `dir` whose name starts with `prefix` (older copies).
pub fn remove_matching(dir: &Path, prefix: &str) {
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(prefix) {
            let _ = fs::remove_file(e.path());
        }
    }
}
