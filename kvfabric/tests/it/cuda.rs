//! CUDA on a real GPU: copies H2D, D2H and D2D through pinned, registered and device memory,
//! events, IPC between two processes, peer access. Every test but the first needs an NVIDIA
//! GPU and driver and is ignored here (the summary counts them as ignored, never as passed);
//! `scripts/gpu-check.sh` runs them with `--ignored` on a GPU machine from prebuilt binaries,
//! with `KVFABRIC_EXPECT_CUDA=1` so that a machine whose driver is broken fails instead of
//! skipping.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use kvfabric::cuda::{self, CudaError, Device, DeviceExport};

fn device() -> Arc<Device> {
    match cuda::probe() {
        Ok(c) => c.device(0).expect("device 0"),
        Err(e) => panic!("{e} (this test needs a GPU; run it through scripts/gpu-check.sh)"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed).collect()
}

#[test]
fn probe_reports_cuda_or_why_not() {
    let expect = std::env::var_os("KVFABRIC_EXPECT_CUDA").is_some();
    match cuda::probe() {
        Ok(c) => {
            assert!(!c.devices().is_empty());
            for d in c.devices() {
                eprintln!("CUDA device {}: {} ({})", d.ordinal(), d.name(), cuda::hex(&d.uuid()));
            }
        }
        Err(e) => {
            assert!(!expect, "KVFABRIC_EXPECT_CUDA is set but {e}");
            assert!(e.to_string().starts_with("no CUDA: "), "{e}");
            eprintln!("CUDA tests are ignored here: {e}");
        }
    }
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
async fn h2d_d2d_d2h_round_trip_through_pinned_registered_and_device_memory() {
    let dev = device();
    let len = 64 << 20;
    let mut src = dev.alloc_pinned(len).unwrap();
    src.as_mut_slice().copy_from_slice(&pattern(len, 7));
    let a = dev.alloc(len).unwrap();
    let b = dev.alloc(len).unwrap();
    // Host memory kvfabric did not allocate (a region's), page-locked in place.
    let mut dst = vec![0u8; len];
    // SAFETY: `dst` outlives the registration, which drops first (declared after).
    let reg = unsafe { dev.register_host(dst.as_mut_ptr(), len) }.unwrap();
    let stream = dev.stream().unwrap();
    let start = stream.record_timed().unwrap();
    // SAFETY: every range is inside its live buffer, which outlives the awaited event.
    unsafe {
        stream.copy_h2d(a.ptr(), src.as_ptr(), len).unwrap();
        // In pieces, as a descriptor list is copied.
        for off in (0..len).step_by(4 << 20) {
            stream.copy_d2d(b.ptr() + off as u64, a.ptr() + off as u64, 4 << 20).unwrap();
        }
        stream.copy_d2h(dst.as_mut_ptr(), b.ptr(), len).unwrap();
    }
    let end = stream.record_timed().unwrap();
    end.done().await.unwrap();
    assert!(end.is_done().unwrap());
    let gpu_time = end.since(&start).unwrap();
    assert!(gpu_time > std::time::Duration::ZERO);
    drop(reg);
    assert!(dst == src.as_slice(), "bytes differ after H2D, D2D, D2H");
    eprintln!("64 MiB H2D + D2D + D2H in {gpu_time:?} of GPU time");
}

/// The child half of the IPC test: maps the parent's export, checks its bytes, and writes
/// its own pattern into the second half. Runs only when the parent starts it.
#[tokio::test]
#[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
async fn ipc_child() {
    let Ok(json) = std::env::var("KVFABRIC_TEST_CUDA_EXPORT") else { return };
    let export: DeviceExport = serde_json::from_str(&json).unwrap();
    let c = cuda::probe().unwrap();
    let dev = c.device_by_uuid(&export.uuid).unwrap();
    let map = dev.open(&export).unwrap();
    let half = map.len() / 2;
    let stream = dev.stream().unwrap();
    let mut seen = dev.alloc_pinned(half).unwrap();
    let mut mine = dev.alloc_pinned(half).unwrap();
    mine.as_mut_slice().copy_from_slice(&pattern(half, 0x5c));
    // SAFETY: ranges inside the mapping and the pinned buffers, all alive past the event.
    unsafe {
        stream.copy_d2h(seen.as_mut_slice().as_mut_ptr(), map.ptr(), half).unwrap();
        stream.copy_h2d(map.ptr() + half as u64, mine.as_ptr(), half).unwrap();
    }
    stream.record().unwrap().done().await.unwrap();
    assert!(seen.as_slice() == pattern(half, 0x11), "the child saw other bytes");
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
async fn ipc_export_is_read_and_written_by_another_process() {
    let dev = device();
    let len = 16 << 20;
    let half = len / 2;
    let buf = dev.alloc(len).unwrap();
    let stream = dev.stream().unwrap();
    let mut host = dev.alloc_pinned(len).unwrap();
    host.as_mut_slice()[..half].copy_from_slice(&pattern(half, 0x11));
    // SAFETY: in-bounds ranges of live buffers, awaited below.
    unsafe { stream.copy_h2d(buf.ptr(), host.as_ptr(), len).unwrap() };
    stream.record().unwrap().done().await.unwrap();
    let export = dev.export(&buf).unwrap();
    // Through the metadata encoding, as a peer agent would get it.
    let json = serde_json::to_string(&export).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "cuda::ipc_child", "--nocapture", "--test-threads", "1"])
        .env("KVFABRIC_TEST_CUDA_EXPORT", json)
        .output()
        .unwrap();
    let log =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("1 passed"), "child failed:\n{log}");
    // SAFETY: as above.
    unsafe { stream.copy_d2h(host.as_mut_slice().as_mut_ptr(), buf.ptr(), len).unwrap() };
    stream.record().unwrap().done().await.unwrap();
    assert!(host.as_slice()[half..] == pattern(half, 0x5c), "the child's write did not land");
}

#[test]
#[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
fn an_export_from_an_unknown_gpu_or_a_forged_handle_is_refused() {
    let dev = device();
    let buf = dev.alloc(1 << 20).unwrap();
    let good = dev.export(&buf).unwrap();
    let mut other = good.clone();
    other.uuid[0] ^= 0xff;
    let c = cuda::probe().unwrap();
    assert!(matches!(c.device_by_uuid(&other.uuid), Err(CudaError::UnknownDevice(_))));
    assert!(matches!(dev.open(&other), Err(CudaError::UnknownDevice(_))));
    let mut forged = good.clone();
    forged.handle = [0xa5; cuda::IPC_HANDLE_BYTES];
    assert!(matches!(dev.open(&forged), Err(CudaError::Driver { .. })));
}

#[tokio::test]
#[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
async fn copies_between_two_gpus_when_there_are_two() {
    let c = cuda::probe().unwrap();
    if c.devices().len() < 2 {
        eprintln!("one GPU: nothing to copy between (this proves nothing about peer copies)");
        return;
    }
    let (d0, d1) = (c.device(0).unwrap(), c.device(1).unwrap());
    eprintln!("peer access 0 -> 1: {}", d0.can_access_peer(&d1).unwrap());
    let len = 8 << 20;
    let mut host = d0.alloc_pinned(len).unwrap();
    host.as_mut_slice().copy_from_slice(&pattern(len, 3));
    let (a, b) = (d0.alloc(len).unwrap(), d1.alloc(len).unwrap());
    let s = d0.stream().unwrap();
    let mut back = d0.alloc_pinned(len).unwrap();
    // SAFETY: in-bounds ranges of live buffers; unified addressing lets one stream copy
    // between devices.
    unsafe {
        s.copy_h2d(a.ptr(), host.as_ptr(), len).unwrap();
        s.copy_d2d(b.ptr(), a.ptr(), len).unwrap();
        s.copy_d2h(back.as_mut_slice().as_mut_ptr(), b.ptr(), len).unwrap();
    }
    s.record().unwrap().done().await.unwrap();
    assert!(back.as_slice() == host.as_slice());
}

mod agent {
    use std::time::Duration;

    use kvfabric::agent::{Agent, AgentConfig, AgentMetadata};
    use kvfabric::memory::{MemoryKind, RegionOptions};
    use kvfabric::transfer::{Desc, TransferOp, TransferRequest, TransportKind};

    use super::pattern;

    const SECRET: &[u8] = b"cuda-agent-test";
    /// Piece size of the IPC write: 16-byte aligned, so the gather kernel moves words.
    const IPC_PIECE: u64 = 64 << 10;

    /// Through the agent: host → GPU, GPU → GPU, GPU → host within one process, each a
    /// transfer of a descriptor list on the cuda transport, the last with a notification.
    #[tokio::test]
    #[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
    async fn an_agent_moves_descriptor_lists_between_host_and_gpu_regions() {
        let a = Agent::start(AgentConfig::new("cuda-local", SECRET.to_vec())).await.unwrap();
        let len = 32usize << 20;
        let host = a.alloc_region(len, RegionOptions::default()).unwrap();
        host.write_at(0, &pattern(len, 9)).unwrap();
        let g1 = a.alloc_device_region(0, len, false).unwrap();
        let g2 = a.alloc_device_region(0, len, false).unwrap();
        assert_eq!(g1.kind(), MemoryKind::Device(0));
        let back = a.alloc_region(len, RegionOptions::default()).unwrap();
        let descs = |r: &kvfabric::memory::Region| -> Vec<Desc> {
            (0..len as u64).step_by(1 << 20).map(|o| Desc::new(r.id(), o, 1 << 20)).collect()
        };
        for (src, dst) in [(&host, &g1), (&g1, &g2)] {
            let req = TransferRequest::new(TransferOp::Write, "cuda-local", descs(src), descs(dst));
            assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Cuda);
            a.post(req).unwrap().wait().await.unwrap();
        }
        let req = TransferRequest::new(TransferOp::Read, "cuda-local", descs(&back), descs(&g2))
            .with_notify(b"landed".to_vec());
        a.post(req).unwrap().wait().await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), a.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, b"landed");
        let mut got = vec![0u8; len];
        back.read_at(0, &mut got).unwrap();
        assert!(got == pattern(len, 9), "bytes differ after host -> GPU -> GPU -> host");
        // Checksums of GPU memory are refused, typed.
        let req = TransferRequest::new(TransferOp::Write, "cuda-local", descs(&host), descs(&g1))
            .with_checksum();
        assert!(a.post(req).unwrap().wait().await.is_err());
    }

    /// Scattered descriptors of odd sizes (slot `i` against slot `n - 1 - i`, so none merge
    /// and the driver gets one batch of many copies): host → GPU, GPU → GPU, and back to
    /// host memory through lists contiguous on both sides (merged into one copy); every byte
    /// lands where its descriptor says.
    #[tokio::test]
    #[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
    async fn scattered_descriptors_land_where_each_one_says() {
        let a = Agent::start(AgentConfig::new("cuda-scatter", SECRET.to_vec())).await.unwrap();
        // Odd pieces (the gather kernel's byte loop), and 16-byte multiples longer than one
        // CTA's share (its word loops, several CTAs per piece).
        for (piece, n) in [(65_537u64, 97u64), (262_160, 33)] {
            scatter(&a, piece, n).await;
        }
    }

    async fn scatter(a: &Agent, piece: u64, n: u64) {
        let len = (piece * n) as usize;
        let host = a.alloc_region(len, RegionOptions::default()).unwrap();
        let src = pattern(len, 0x5a);
        host.write_at(0, &src).unwrap();
        let g1 = a.alloc_device_region(0, len, false).unwrap();
        let g2 = a.alloc_device_region(0, len, false).unwrap();
        let back = a.alloc_region(len, RegionOptions::default()).unwrap();
        let fwd = |r: &kvfabric::memory::Region| -> Vec<Desc> {
            (0..n).map(|i| Desc::new(r.id(), i * piece, piece)).collect()
        };
        let rev = |r: &kvfabric::memory::Region| -> Vec<Desc> {
            (0..n).map(|i| Desc::new(r.id(), (n - 1 - i) * piece, piece)).collect()
        };
        // host slot i → g1 slot n-1-i → g2 slot i (reversed twice) → back, contiguous.
        for req in [
            TransferRequest::new(TransferOp::Write, "cuda-scatter", fwd(&host), rev(&g1)),
            TransferRequest::new(TransferOp::Write, "cuda-scatter", rev(&g1), fwd(&g2)),
            TransferRequest::new(TransferOp::Read, "cuda-scatter", fwd(&back), fwd(&g2)),
        ] {
            assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Cuda);
            a.post(req).unwrap().wait().await.unwrap();
        }
        let mut got = vec![0u8; len];
        back.read_at(0, &mut got).unwrap();
        assert!(got == src, "bytes differ after a reversal there and back");
        // One reversal only: g1 holds the slots in reverse order.
        a.post(TransferRequest::new(TransferOp::Read, "cuda-scatter", fwd(&back), fwd(&g1)))
            .unwrap()
            .wait()
            .await
            .unwrap();
        back.read_at(0, &mut got).unwrap();
        for i in 0..n as usize {
            let (p, j) = (piece as usize, n as usize - 1 - i);
            assert!(got[i * p..(i + 1) * p] == src[j * p..(j + 1) * p], "slot {i} of {piece} B");
        }
    }

    /// GPU memory to host memory of another host, and back: staged through pinned bounce
    /// buffers over TCP (the agents run with shm off, so each treats the other as remote),
    /// 20 MiB in odd-sized descriptors (three 8 MiB chunks), with checksums and a
    /// notification.
    #[tokio::test]
    #[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
    async fn gpu_memory_reaches_another_host_staged_through_bounce_buffers() {
        let config = |name: &str| {
            let mut c = AgentConfig::new(name, SECRET.to_vec());
            c.shm = false;
            c
        };
        let a = Agent::start(config("cuda-stage-a")).await.unwrap();
        let b = Agent::start(config("cuda-stage-b")).await.unwrap();
        let len = 20usize << 20;
        let remote =
            b.alloc_region(len, RegionOptions { export: true, ..Default::default() }).unwrap();
        a.load_peer(b.metadata()).unwrap();
        b.load_peer(a.metadata()).unwrap();
        let host = a.alloc_region(len, RegionOptions::default()).unwrap();
        host.write_at(0, &pattern(len, 0x3c)).unwrap();
        let g = a.alloc_device_region(0, len, false).unwrap();
        let g2 = a.alloc_device_region(0, len, false).unwrap();
        let whole = |r: &kvfabric::memory::Region| vec![Desc::new(r.id(), 0, len as u64)];
        a.post(TransferRequest::new(TransferOp::Write, "cuda-stage-a", whole(&host), whole(&g)))
            .unwrap()
            .wait()
            .await
            .unwrap();
        let cut = |r: &kvfabric::memory::Region| -> Vec<Desc> {
            (0..len as u64)
                .step_by(999_999)
                .map(|o| Desc::new(r.id(), o, 999_999.min(len as u64 - o)))
                .collect()
        };
        let req = TransferRequest::new(TransferOp::Write, "cuda-stage-b", cut(&g), cut(&remote))
            .with_checksum()
            .with_notify(b"staged".to_vec());
        assert_eq!(a.transport_for(&req).unwrap(), TransportKind::Cuda);
        a.post(req).unwrap().wait().await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), b.next_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.message, b"staged");
        let mut got = vec![0u8; len];
        remote.read_at(0, &mut got).unwrap();
        assert!(got == pattern(len, 0x3c), "the staged WRITE landed other bytes");
        let req = TransferRequest::new(TransferOp::Read, "cuda-stage-b", cut(&g2), cut(&remote))
            .with_checksum();
        a.post(req).unwrap().wait().await.unwrap();
        host.fill(0, len as u64, 0).unwrap();
        a.post(TransferRequest::new(TransferOp::Write, "cuda-stage-a", whole(&g2), whole(&host)))
            .unwrap()
            .wait()
            .await
            .unwrap();
        host.read_at(0, &mut got).unwrap();
        assert!(got == pattern(len, 0x3c), "the staged READ landed other bytes");
    }

    /// The child half of the IPC transfer test: loads the parent's metadata and WRITEs its
    /// pattern into the parent's GPU region through CUDA IPC, with a notification.
    #[tokio::test]
    #[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
    async fn ipc_writer_child() {
        let Ok(md) = std::env::var("KVFABRIC_TEST_CUDA_PEER") else { return };
        let md = AgentMetadata::from_bytes(md.as_bytes()).unwrap();
        let region = md.regions[0].id;
        let len = md.regions[0].len as usize;
        let b = Agent::start(AgentConfig::new("cuda-child", SECRET.to_vec())).await.unwrap();
        b.load_peer(md).unwrap();
        let src = b.alloc_region(len, RegionOptions::default()).unwrap();
        src.write_at(0, &pattern(len, 0x77)).unwrap();
        // Into this process's GPU memory first, then GPU to GPU through the IPC mapping in
        // IPC_PIECE pieces, slot i to the parent's slot n-1-i (the gather kernel's work).
        let g = b.alloc_device_region(0, len, false).unwrap();
        let whole = |id| vec![Desc::new(id, 0, len as u64)];
        b.post(TransferRequest::new(
            TransferOp::Write,
            "cuda-child",
            whole(src.id()),
            whole(g.id()),
        ))
        .unwrap()
        .wait()
        .await
        .unwrap();
        let n = len as u64 / IPC_PIECE;
        let req = TransferRequest::new(
            TransferOp::Write,
            "cuda-parent",
            (0..n).map(|i| Desc::new(g.id(), i * IPC_PIECE, IPC_PIECE)).collect(),
            (0..n).map(|i| Desc::new(region, (n - 1 - i) * IPC_PIECE, IPC_PIECE)).collect(),
        )
        .with_notify(b"from the child".to_vec());
        assert_eq!(b.transport_for(&req).unwrap(), TransportKind::Cuda);
        b.post(req).unwrap().wait().await.unwrap();
    }

    #[tokio::test]
    #[ignore = "needs an NVIDIA GPU and driver: scripts/gpu-check.sh runs it"]
    async fn a_peer_process_writes_into_an_exported_gpu_region_through_cuda_ipc() {
        let a = Agent::start(AgentConfig::new("cuda-parent", SECRET.to_vec())).await.unwrap();
        let len = 8usize << 20;
        let g = a.alloc_device_region(0, len, true).unwrap();
        let md = a.metadata();
        assert!(md.regions[0].cuda_ipc.is_some(), "no IPC export in the metadata");
        let child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "cuda::agent::ipc_writer_child", "--nocapture"])
            .env("KVFABRIC_TEST_CUDA_PEER", String::from_utf8(md.to_bytes()).unwrap())
            .output();
        let n = tokio::time::timeout(Duration::from_secs(60), a.next_notification());
        let (out, n) = tokio::join!(child, n);
        let out = out.unwrap();
        let log = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success() && log.contains("1 passed"), "child failed:\n{log}");
        let n = n.unwrap().unwrap();
        assert_eq!((n.from.as_str(), n.message.as_slice()), ("cuda-child", &b"from the child"[..]));
        // Read the GPU region back through a local transfer.
        let host = a.alloc_region(len, RegionOptions::default()).unwrap();
        let req = TransferRequest::new(
            TransferOp::Read,
            "cuda-parent",
            vec![Desc::new(host.id(), 0, len as u64)],
            vec![Desc::new(g.id(), 0, len as u64)],
        );
        a.post(req).unwrap().wait().await.unwrap();
        let mut got = vec![0u8; len];
        host.read_at(0, &mut got).unwrap();
        let (want, p, n) = (pattern(len, 0x77), IPC_PIECE as usize, len / IPC_PIECE as usize);
        for i in 0..n {
            let j = n - 1 - i;
            assert!(got[i * p..(i + 1) * p] == want[j * p..(j + 1) * p], "piece {i}");
        }
    }
}
