//! `ebpf-proxy cleanup`: unpins the agent's TC links (the kernel detaches a
//! link once nothing holds it) and its maps, then removes the directory if it
//! is left empty. Nothing the agent did not create is touched.

use std::path::Path;

use anyhow::{Context, Result};

use crate::maps::{PINNED_MAPS, links_dir};

pub fn cleanup(root: &Path) -> Result<()> {
    if !root.exists() {
        println!("nothing to clean: {} does not exist", root.display());
        return Ok(());
    }
    let mut removed = 0;
    let links = links_dir(root);
    if let Ok(entries) = std::fs::read_dir(&links) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("ingress-") {
                std::fs::remove_file(e.path()).with_context(|| format!("unpin {}", e.path().display()))?;
                removed += 1;
            }
        }
        let _ = std::fs::remove_dir(&links);
    }
    for name in PINNED_MAPS {
        let path = root.join(name);
        if path.exists() {
            std::fs::remove_file(&path).with_context(|| format!("unpin {}", path.display()))?;
            removed += 1;
        }
    }
    let _ = std::fs::remove_dir(root);
    println!("removed {removed} pinned objects under {}", root.display());
    Ok(())
}
