//! Where this kernel keeps `sk_buff::ip_summed`, read from its BTF.
//!
//! The datapath must not patch the SCTP CRC of a packet whose checksum the
//! kernel computes later (`CHECKSUM_PARTIAL`). `__sk_buff` does not expose
//! `ip_summed`, so the program reads it from the real `struct sk_buff`
//! (kfunc `bpf_cast_to_kern_ctx`), at the offset found here. Rust BPF has no
//! CO-RE field relocations, hence this done-by-the-loader equivalent.

use std::path::Path;

use anyhow::{Context, Result};
use btfparse::{Offset, Readable, TypeInformation};

pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Globals in the BPF object (proxy-ebpf/src/sctp.rs).
pub const GLOBAL_OFF: &str = "SKB_IP_SUMMED_OFF";
pub const GLOBAL_SHIFT: &str = "SKB_IP_SUMMED_SHIFT";

/// The byte holding the 2-bit `ip_summed` field, and its shift in that byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpSummed {
    pub byte: u32,
    pub shift: u32,
}

/// Reads the layout from a BTF file (normally [`VMLINUX_BTF`]).
pub fn ip_summed(btf: &Path) -> Result<IpSummed> {
    let bytes = InMemory(std::fs::read(btf).with_context(|| format!("reading {}", btf.display()))?);
    let types = TypeInformation::new(&bytes).map_err(|e| anyhow::anyhow!("{}: {e:?}", btf.display()))?;
    let skb = types.id_of("sk_buff").with_context(|| format!("{}: no struct sk_buff", btf.display()))?;
    let (_, offset) = types
        .offset_of(skb, "ip_summed")
        .map_err(|e| anyhow::anyhow!("{}: sk_buff.ip_summed: {e:?}", btf.display()))?;
    from_offset(offset)
}

/// BTF read once into memory (a few MiB): the parser reads it in many small pieces.
struct InMemory(Vec<u8>);

impl Readable for InMemory {
    fn read(&self, offset: u64, buffer: &mut [u8]) -> btfparse::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let src = start.checked_add(buffer.len()).and_then(|end| self.0.get(start..end));
        let src = src.ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        buffer.copy_from_slice(src);
        Ok(())
    }
}

/// Bit offsets are little-endian bit numbers (x86, arm64 — the BPF targets we
/// build for); the field must sit in one byte for a single-byte read.
fn from_offset(offset: Offset) -> Result<IpSummed> {
    match offset {
        Offset::BitOffsetAndSize(bit, 2) if bit % 8 <= 6 => Ok(IpSummed { byte: bit / 8, shift: bit % 8 }),
        Offset::ByteOffset(byte) => Ok(IpSummed { byte, shift: 0 }),
        other => anyhow::bail!("sk_buff.ip_summed has an unexpected layout {other:?} (want a 2-bit field within one byte)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitfield_offsets_map_to_byte_and_shift() {
        assert_eq!(from_offset(Offset::BitOffsetAndSize(1029, 2)).unwrap(), IpSummed { byte: 128, shift: 5 });
        assert_eq!(from_offset(Offset::ByteOffset(40)).unwrap(), IpSummed { byte: 40, shift: 0 });
        // Straddling two bytes, or not 2 bits wide: refused, not misread.
        assert!(from_offset(Offset::BitOffsetAndSize(1031, 2)).is_err());
        assert!(from_offset(Offset::BitOffsetAndSize(1024, 3)).is_err());
    }

    #[test]
    fn running_kernel_has_the_field() {
        let l = ip_summed(Path::new(VMLINUX_BTF)).unwrap();
        // struct sk_buff is a few hundred bytes; the field is in its first part.
        assert!(l.byte > 0 && l.byte < 256 && l.shift <= 6, "{l:?}");
    }
}
