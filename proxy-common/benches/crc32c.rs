//! Cost of the SCTP CRC32c port-rewrite update on the host, next to
//! recomputing the CRC over the whole packet. `cargo bench -p proxy-common`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use proxy_common::crc32c::{crc32c, update_for_change, update_port};

fn port_update(c: &mut Criterion) {
    let mut g = c.benchmark_group("sctp_port_rewrite");
    // Common header + one chunk; a 1400-byte DATA; the largest IP payload.
    for len in [32usize, 1400, 65_515] {
        let packet = vec![0xa5u8; len];
        // The cost does not depend on the length (a fixed 16 multiplications)...
        g.bench_with_input(BenchmarkId::new("update_port", len), &len, |b, &len| {
            b.iter(|| update_port(black_box(0x1234_5678), black_box([0x0b, 0x59]), black_box([0x0f, 0x41]), (len - 4) as u16))
        });
        // ...while recomputing grows with it.
        g.bench_with_input(BenchmarkId::new("recompute", len), &packet, |b, p| b.iter(|| crc32c(black_box(p))));
    }
    g.bench_function("update_for_change_4_bytes_32bit_distance", |b| {
        b.iter(|| update_for_change(black_box(1), black_box([1, 2, 3, 4]), black_box([5, 6, 7, 8]), black_box(1396)))
    });
    g.finish();
}

criterion_group!(benches, port_update);
criterion_main!(benches);
