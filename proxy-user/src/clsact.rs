//! The clsact qdiscs the agent added for its netlink filters (kernels
//! without TCX), so `cleanup` removes those and only those. A qdisc that was
//! there before the agent, or that holds anyone else's filter by then, stays.
//! The record is an empty directory `<bpffs-root>/clsact/<ifindex>` (bpffs
//! holds no regular files), written when the agent adds the qdisc.

use std::path::{Path, PathBuf};

use anyhow::Result;
use futures::TryStreamExt;
use netlink_packet_route::tc::TcHandle;

fn dir(root: &Path) -> PathBuf {
    root.join("clsact")
}

/// The agent added the clsact qdisc of `ifindex`.
pub fn record_added(root: &Path, ifindex: u32) -> Result<()> {
    Ok(std::fs::create_dir_all(dir(root).join(ifindex.to_string()))?)
}

/// The interface is gone, and its qdisc with it.
pub fn forget(root: &Path, ifindex: u32) {
    let _ = std::fs::remove_dir(dir(root).join(ifindex.to_string()));
}

/// Removes every clsact qdisc the agent added that no filter uses any more
/// (call after our filters are gone), and the records. Returns how many
/// qdiscs were removed.
pub fn remove_unused(root: &Path) -> Result<usize> {
    let records: Vec<u32> = std::fs::read_dir(dir(root))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut removed = 0;
    if !records.is_empty() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        removed = rt.block_on(async {
            let (conn, handle, _) = rtnetlink::new_connection()?;
            tokio::spawn(conn);
            let mut removed = 0;
            for &ifindex in &records {
                if remove_if_unused(&handle, ifindex).await.unwrap_or(false) {
                    removed += 1;
                }
            }
            anyhow::Ok(removed)
        })?;
    }
    for ifindex in records {
        forget(root, ifindex);
    }
    let _ = std::fs::remove_dir(dir(root));
    Ok(removed)
}

async fn remove_if_unused(handle: &rtnetlink::Handle, ifindex: u32) -> Result<bool> {
    let index = ifindex as i32;
    for get in [handle.traffic_filter(index).get().ingress(), handle.traffic_filter(index).get().egress()] {
        if get.execute().try_next().await?.is_some() {
            return Ok(false);
        }
    }
    let mut del = handle.qdisc().del(index);
    del.message_mut().header.parent = TcHandle::CLSACT;
    del.message_mut().header.handle = TcHandle { major: 0xffff, minor: 0 };
    del.execute().await?;
    Ok(true)
}
