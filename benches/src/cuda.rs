//! The `cuda` rows of `kvfabric bench transfer`: H2D, D2H (page-locked host memory) and D2D
//! copies of a descriptor list through the agent — a local transfer on the `cuda` transport,
//! as the tiered store and the C ABI post them — against the limit measured in the same run:
//! one raw `cuMemcpy*Async` of the same bytes, contiguous, followed by `cuStreamSynchronize`.
//!
//! Rows `cuda-ipc`: WRITE and READ between a GPU region of this process and a GPU region of
//! a peer process (`kvfabric peer --device-bytes`) through the agent — descriptor lists on
//! the `cuda` transport over CUDA IPC — against one raw `cuMemcpyDtoDAsync` of the same bytes
//! within this process.
//!
//! Descriptors are scattered: descriptor `i` at slot `i` on one side and at slot
//! `batch - 1 - i` on the other, so that no two are contiguous on both sides and the
//! transport cannot merge them (KV blocks of a request rarely sit in order). Every
//! descriptor is one copy: the ratio includes the per-copy cost.
//!
//! On a machine without CUDA, [`rows`] fails with the typed reason (no driver, no GPU, a
//! build without the feature), which the caller prints.

use crate::Host;
use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::Agent;
use kvfabric::cuda::{self, CopyOp, DeviceBuffer, PinnedBuffer, Stream};
use kvfabric::memory::{MemoryKind, Region, RegionId, RegionOptions};
use kvfabric::transfer::{Desc, TransferOp, TransferRequest, TransportKind};
use kvfabric_planner::stats::gbps;

use crate::measure::{
    combos, keep_measuring, measure_posts, measure_sync, rand_u64, spawn_peer, Row,
};

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

/// The raw buffers of the limit.
struct Buffers {
    host: PinnedBuffer,
    a: DeviceBuffer,
    b: DeviceBuffer,
}

impl Buffers {
    /// Queues `len` bytes at `off` in the direction of `op`.
    fn copy(&self, s: &Stream, op: Op, off: u64, len: u64) -> crate::Result<()> {
        crate::ensure!(off + len <= self.a.len() as u64, "copy outside the buffers");
        let (o, n) = (off as usize, len as usize);
        // SAFETY: `off + len` is inside every buffer (checked above); the buffers outlive the
        // synchronize that ends each measurement.
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

/// Prints what each way of learning that one 64 KiB H2D copy completed costs (median): the
/// floor (`cuStreamSynchronize` on this thread), an event synchronized on this thread, an
/// event polled from this task, and an event awaited through the device's waiting thread.
/// The data path polls, then waits; the difference to the floor is the fixed cost of every
/// transfer on top of its copies.
async fn completion_costs(bufs: &Buffers, s: &Stream, min_time: Duration) -> crate::Result<()> {
    let len = 64 << 10;
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let floor = measure_sync(min_time, || {
        bufs.copy(s, Op::H2d, 0, len)?;
        Ok(s.synchronize()?)
    })?;
    let event_sync = measure_sync(min_time, || {
        bufs.copy(s, Op::H2d, 0, len)?;
        Ok(s.record()?.synchronize()?)
    })?;
    let (mut polled, mut waited) = (Vec::new(), Vec::new());
    for (out, spin) in [(&mut polled, Duration::from_millis(1)), (&mut waited, Duration::ZERO)] {
        let start = std::time::Instant::now();
        while keep_measuring(out.len(), start, min_time) {
            let t = std::time::Instant::now();
            bufs.copy(s, Op::H2d, 0, len)?;
            s.record()?.done_polling(spin).await?;
            out.push(t.elapsed());
        }
    }
    eprintln!(
        "cuda: completion of one 64 KiB H2D copy (median): stream synchronize {:?}, event synchronize {:?}, event polled {:?}, event awaited on the waiting thread {:?}",
        median(floor),
        median(event_sync),
        median(polled),
        median(waited)
    );
    // The device's own ways of moving scattered blocks, without the agent: 16 copies of
    // 1/16 of the buffer, slot i to slot 15-i.
    let total = bufs.a.len() as u64 / 16 * 16;
    let piece = total / 16;
    let copies: Vec<CopyOp> = (0..16)
        .map(|i| CopyOp {
            src: bufs.a.ptr() + i * piece,
            dst: bufs.b.ptr() + (15 - i) * piece,
            len: piece as usize,
        })
        .collect();
    let mut table = s.device().alloc_copy_table(16)?;
    let one = measure_sync(min_time, || {
        bufs.copy(s, Op::D2d, 0, total)?;
        Ok(s.synchronize()?)
    })?;
    let batch = measure_sync(min_time, || {
        // SAFETY: the ranges lie in the buffers, which outlive the synchronize below.
        unsafe { s.copy_batch(&copies) }?;
        Ok(s.synchronize()?)
    })?;
    let gather = measure_sync(min_time, || {
        // SAFETY: as above; the table is rewritten only after the synchronize below.
        unsafe { s.copy_table(&mut table, &copies) }?;
        Ok(s.synchronize()?)
    })?;
    let rate = |v: &[Duration]| gbps(total * v.len() as u64, v.iter().sum());
    eprintln!(
        "cuda: {} MiB D2D in 16 scattered copies, raw: one contiguous copy {:.0} GB/s, cuMemcpyBatchAsync {:.0} GB/s, gather kernel {:.0} GB/s",
        total >> 20,
        rate(&one),
        rate(&batch),
        rate(&gather)
    );
    Ok(())
}

/// `batch` descriptors of `desc` bytes: slot `i` of `local` against slot `batch - 1 - i` of
/// `remote`.
fn scattered(local: RegionId, remote: RegionId, desc: u64, batch: usize) -> (Vec<Desc>, Vec<Desc>) {
    let n = batch as u64;
    (
        (0..n).map(|i| Desc::new(local, i * desc, desc)).collect(),
        (0..n).map(|i| Desc::new(remote, (n - 1 - i) * desc, desc)).collect(),
    )
}

/// The rows for every `(descriptor size, batch)` that fits in `max_bytes`.
pub(crate) async fn rows(
    run: &Host,
    sizes: &[u64],
    batches: &[usize],
    max_bytes: usize,
    min_time: Duration,
) -> crate::Result<Vec<Row>> {
    let cuda = cuda::probe()?;
    let dev = cuda.device(0)?;
    eprintln!("cuda: device 0, {}", dev.name());
    let bufs = Buffers {
        host: dev.alloc_pinned(max_bytes)?,
        a: dev.alloc(max_bytes)?,
        b: dev.alloc(max_bytes)?,
    };
    let stream = dev.stream()?;
    completion_costs(&bufs, &stream, min_time).await?;
    let secret = format!("{:016x}", rand_u64());
    let agent = Agent::start(run.agent_config("bench-cuda-local", secret.into_bytes())).await?;
    // kvfabric's side: a host region page-locked in place (as the tiered store pins its host
    // tier) and two GPU regions.
    let host: Arc<Region> = agent.alloc_region(max_bytes, RegionOptions::default())?;
    let host_ptr = host.ptr_at(0, max_bytes as u64)?;
    // SAFETY: the region stays registered and mapped (the agent and `host` hold it) until
    // after `_pinned` drops at the end of this function.
    let _pinned = unsafe { dev.register_host(host_ptr, max_bytes) }?;
    let a = agent.alloc_device_region(0, max_bytes, false)?;
    let b = agent.alloc_device_region(0, max_bytes, false)?;
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
            let (src, dst) = match op {
                Op::H2d => (&host, &a),
                Op::D2h => (&a, &host),
                Op::D2d => (&a, &b),
            };
            let (l, r) = scattered(src.id(), dst.id(), desc, batch);
            let req = TransferRequest::new(TransferOp::Write, agent.name(), l, r)
                .with_deadline(Duration::from_secs(60));
            let ours = measure_posts(&agent, &req, min_time).await?;
            let limit_gbps = gbps(bytes * limit.len() as u64, limit.iter().sum());
            rows.push(Row::measured(
                ("cuda", op.name()),
                (desc, batch),
                &ours,
                ("cuMemcpyAsync", limit_gbps),
            ));
        }
    }
    rows.extend(ipc_rows(run, sizes, batches, max_bytes, min_time, &bufs, &stream).await?);
    Ok(rows)
}

/// The `cuda-ipc` rows (see the module docs).
async fn ipc_rows(
    host: &Host,
    sizes: &[u64],
    batches: &[usize],
    max_bytes: usize,
    min_time: Duration,
    bufs: &Buffers,
    stream: &Stream,
) -> crate::Result<Vec<Row>> {
    let secret = format!("{:016x}", rand_u64());
    let dev_bytes = max_bytes.to_string();
    let (mut child, md) = spawn_peer(host, &secret, 4096, &["--device-bytes", &dev_bytes]).await?;
    let remote = md
        .regions
        .iter()
        .find(|r| r.kind != MemoryKind::Host)
        .map(|r| r.id)
        .ok_or_else(|| crate::failed!("the peer exported no GPU region"))?;
    let agent = Agent::start(host.agent_config("bench-cuda", secret.into_bytes())).await?;
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
            let (l, r) = scattered(local.id(), remote, desc, batch);
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
