//! The `cuda` rows of `kvfabric bench transfer`: H2D, D2H (pinned host memory) and D2D copies
//! of a descriptor list through `kvfabric::cuda` — one queued copy per descriptor on one
//! stream, completion awaited through the device's waiting thread, as the data path does —
//! against the limit measured in the same run: one raw `cuMemcpy*Async` of the same bytes,
//! contiguous, followed by `cuStreamSynchronize`.
//!
//! On a machine without CUDA, [`rows`] fails with the typed reason (no driver, no GPU, a
//! build without the feature), which the caller prints.

use std::time::{Duration, Instant};

use kvfabric::cuda::{self, DeviceBuffer, PinnedBuffer, Stream};
use kvfabric_serving::stats::{gbps, Percentiles};

use super::transfer::{keep_measuring, Row};

#[derive(Debug, Clone, Copy)]
enum Op {
    H2d,
    D2h,
    D2d,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::H2d => "h2d",
            Op::D2h => "d2h",
            Op::D2d => "d2d",
        }
    }
}

struct Buffers {
    host: PinnedBuffer,
    a: DeviceBuffer,
    b: DeviceBuffer,
}

impl Buffers {
    /// Queues `len` bytes at `off` in the direction of `op`.
    fn copy(&self, s: &Stream, op: Op, off: u64, len: u64) -> anyhow::Result<()> {
        anyhow::ensure!(off + len <= self.a.len() as u64, "copy outside the buffers");
        let (o, n) = (off as usize, len as usize);
        // SAFETY: `off + len` is inside every buffer (checked above); the buffers outlive the
        // awaited event that ends each measurement.
        unsafe {
            match op {
                Op::H2d => s.copy_h2d(self.a.ptr() + off, self.host.as_ptr().add(o), n)?,
                Op::D2h => s.copy_d2h(self.host.as_ptr().add(o), self.a.ptr() + off, n)?,
                Op::D2d => s.copy_d2d(self.b.ptr() + off, self.a.ptr() + off, n)?,
            }
        }
        Ok(())
    }
}

/// The rows for every `(descriptor size, batch)` that fits in `max_bytes`.
pub async fn rows(
    sizes: &[u64],
    batches: &[usize],
    max_bytes: usize,
    min_time: Duration,
) -> anyhow::Result<Vec<Row>> {
    let cuda = cuda::probe()?;
    let dev = cuda.device(0)?;
    eprintln!("cuda: device 0, {}", dev.name());
    let bufs = Buffers {
        host: dev.alloc_pinned(max_bytes)?,
        a: dev.alloc(max_bytes)?,
        b: dev.alloc(max_bytes)?,
    };
    let stream = dev.stream()?;
    let mut rows = Vec::new();
    for &desc in sizes {
        for &batch in batches {
            let bytes = desc.saturating_mul(batch as u64);
            if bytes > max_bytes as u64 {
                continue;
            }
            for op in [Op::H2d, Op::D2h, Op::D2d] {
                // The limit: one contiguous copy, synchronized directly.
                let mut limit = Vec::new();
                let start = Instant::now();
                while keep_measuring(limit.len(), start, min_time) {
                    let t = Instant::now();
                    bufs.copy(&stream, op, 0, bytes)?;
                    stream.synchronize()?;
                    limit.push(t.elapsed());
                }
                // kvfabric's path: a copy per descriptor, awaited through an event.
                let mut ours = Vec::new();
                let start = Instant::now();
                while keep_measuring(ours.len(), start, min_time) {
                    let t = Instant::now();
                    for i in 0..batch as u64 {
                        bufs.copy(&stream, op, i * desc, desc)?;
                    }
                    stream.record()?.done().await?;
                    ours.push(t.elapsed());
                }
                let p = Percentiles::of(&ours);
                let rate = gbps(bytes * ours.len() as u64, ours.iter().sum());
                let limit_gbps = gbps(bytes * limit.len() as u64, limit.iter().sum());
                rows.push(Row {
                    transport: "cuda",
                    op: op.name(),
                    desc_bytes: desc,
                    batch,
                    bytes,
                    iterations: ours.len(),
                    gbps: rate,
                    p50_us: p.p50_us,
                    p99_us: p.p99_us,
                    limit: "cuMemcpyAsync",
                    limit_gbps,
                    ratio_to_limit: rate / limit_gbps,
                    memcpy_gbps: f64::NAN,
                    tcp_socket_gbps: f64::NAN,
                    checksum: false,
                });
            }
        }
    }
    Ok(rows)
}
