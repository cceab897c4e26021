//! The `cuda` rows of `kvfabric bench transfer`: H2D, D2H (pinned host memory) and D2D copies
//! of a descriptor list through `kvfabric::cuda` — one queued copy per descriptor on one
//! stream, completion awaited through the device's waiting thread, as the data path does —
//! against the limit measured in the same run: one raw `cuMemcpy*Async` of the same bytes,
//! contiguous, followed by `cuStreamSynchronize`.
//!
//! Rows `cuda-ipc`: WRITE and READ between a GPU region of this process and a GPU region of
//! a peer process (`kvfabric peer --device-bytes`) through the agent — descriptor lists on
//! the `cuda` transport over CUDA IPC — against one raw `cuMemcpyDtoDAsync` of the same bytes
//! within this process.
//!
//! On a machine without CUDA, [`rows`] fails with the typed reason (no driver, no GPU, a
//! build without the feature), which the caller prints.

use std::time::{Duration, Instant};

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::cuda::{self, DeviceBuffer, PinnedBuffer, Stream};
use kvfabric::memory::MemoryKind;
use kvfabric::transfer::{Desc, TransferOp, TransferRequest, TransportKind};
use kvfabric_serving::stats::gbps;

use super::transfer::{combos, keep_measuring, measure_posts, measure_sync, Row};

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
    for (desc, batch) in combos(sizes, batches, max_bytes as u64) {
        let bytes = desc * batch as u64;
        for op in [Op::H2d, Op::D2h, Op::D2d] {
            eprintln!("[cuda] {} {desc}×{batch}", op.name());
            // The limit: one contiguous copy, synchronized directly.
            let limit = measure_sync(min_time, || {
                bufs.copy(&stream, op, 0, bytes)?;
                Ok(stream.synchronize()?)
            })?;
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
            let limit_gbps = gbps(bytes * limit.len() as u64, limit.iter().sum());
            rows.push(Row::measured(
                ("cuda", op.name()),
                (desc, batch),
                &ours,
                ("cuMemcpyAsync", limit_gbps),
            ));
        }
    }
    rows.extend(ipc_rows(sizes, batches, max_bytes, min_time, &bufs, &stream).await?);
    Ok(rows)
}

/// The `cuda-ipc` rows (see the module docs).
async fn ipc_rows(
    sizes: &[u64],
    batches: &[usize],
    max_bytes: usize,
    min_time: Duration,
    bufs: &Buffers,
    stream: &Stream,
) -> anyhow::Result<Vec<Row>> {
    let secret = format!("{:016x}", super::transfer::rand_u64());
    let dev_bytes = max_bytes.to_string();
    let (mut child, md) =
        super::transfer::spawn_peer(&secret, 4096, &["--device-bytes", &dev_bytes]).await?;
    let remote = md
        .regions
        .iter()
        .find(|r| r.kind != MemoryKind::Host)
        .map(|r| r.id)
        .ok_or_else(|| anyhow::anyhow!("the peer exported no GPU region"))?;
    let agent = Agent::start(AgentConfig::new("bench-cuda", secret.into_bytes())).await?;
    agent.load_peer(md.clone())?;
    let local = agent.alloc_device_region(0, max_bytes, false)?;
    let mut rows = Vec::new();
    for (desc, batch) in combos(sizes, batches, max_bytes as u64) {
        let bytes = desc * batch as u64;
        let limit = measure_sync(min_time, || {
            bufs.copy(stream, Op::D2d, 0, bytes)?;
            Ok(stream.synchronize()?)
        })?;
        let limit_gbps = gbps(bytes * limit.len() as u64, limit.iter().sum());
        for op in [TransferOp::Write, TransferOp::Read] {
            let name = kvfabric::agent::op_name(op);
            eprintln!("[cuda-ipc] {name} {desc}×{batch}");
            let l: Vec<Desc> =
                (0..batch as u64).map(|i| Desc::new(local.id(), i * desc, desc)).collect();
            let r: Vec<Desc> =
                (0..batch as u64).map(|i| Desc::new(remote, i * desc, desc)).collect();
            let req = TransferRequest::new(op, &md.name, l, r)
                .with_transport(TransportKind::Cuda)
                .with_deadline(Duration::from_secs(60));
            let lat = measure_posts(&agent, &req, min_time).await?;
            rows.push(Row::measured(
                ("cuda-ipc", name),
                (desc, batch),
                &lat,
                ("cuMemcpyDtoDAsync", limit_gbps),
            ));
        }
    }
    let _ = child.start_kill();
    Ok(rows)
}
