//! GPU regions in the transfer engine, on a machine without a GPU: they are published as GPU
//! memory, every transport but `cuda` refuses them with a typed error (no host access of a
//! device address ever happens), and without CUDA a transfer that names one fails at `post`
//! saying why. What this cannot prove: that CUDA copies move the bytes (tests/it/cuda.rs does,
//! on a GPU, through scripts/gpu-check.sh).

use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::memory::{MemoryKind, RegionOptions};
use kvfabric::transfer::{Desc, TransferError, TransferOp, TransferRequest, TransportKind};

async fn agent(name: &str) -> Agent {
    Agent::start(AgentConfig::new(name, b"gpu-memory-secret".to_vec())).await.unwrap()
}

#[tokio::test]
async fn gpu_regions_are_published_and_refused_by_every_host_transport() {
    let a = agent("gpu-a").await;
    let b = agent("gpu-b").await;
    // An engine's GPU allocation, registered by address: nothing here dereferences it.
    // SAFETY: the address is never used for a host access (what this test checks).
    let gpu = unsafe { b.register_device_unchecked(0x7e00_0000_0000, 1 << 20, 0, true) }.unwrap();
    let md = b.metadata();
    let exported = md.regions.iter().find(|r| r.id == gpu.id()).unwrap();
    assert_eq!(exported.kind, MemoryKind::Device(0));
    assert!(exported.cuda_ipc.is_none(), "an engine's allocation has no IPC export");
    // Metadata from an agent that predates GPU memory (no "kind") reads as host memory.
    let mut json: serde_json::Value = serde_json::from_slice(&md.to_bytes()).unwrap();
    json["regions"][0].as_object_mut().unwrap().remove("kind");
    let old = kvfabric::agent::AgentMetadata::from_bytes(json.to_string().as_bytes()).unwrap();
    assert_eq!(old.regions[0].kind, MemoryKind::Host);

    a.load_peer(md).unwrap();
    let host = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let write = |transport: Option<TransportKind>| {
        let mut r = TransferRequest::new(
            TransferOp::Write,
            "gpu-b",
            vec![Desc::new(host.id(), 0, 4096)],
            vec![Desc::new(gpu.id(), 0, 4096)],
        )
        .with_deadline(Duration::from_secs(5));
        r.transport = transport;
        r
    };
    for t in [Some(TransportKind::Tcp), Some(TransportKind::Shm), Some(TransportKind::Local)] {
        match a.post(write(t)) {
            Err(TransferError::NoTransport { reason, .. }) => {
                assert!(reason.contains("cannot reach GPU memory"), "{t:?}: {reason}")
            }
            other => panic!("{t:?}: {other:?}"),
        }
    }
    // A peer whose metadata lies (the GPU region claimed as host memory) gets past its own
    // checks: the owner refuses the bytes (its host access of GPU memory fails typed).
    let mut forged = b.metadata();
    for r in &mut forged.regions {
        r.kind = MemoryKind::Host;
    }
    let liar = agent("gpu-liar").await;
    liar.load_peer(forged).unwrap();
    let liar_host = liar.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let lie = TransferRequest::new(
        TransferOp::Write,
        "gpu-b",
        vec![Desc::new(liar_host.id(), 0, 4096)],
        vec![Desc::new(gpu.id(), 0, 4096)],
    )
    .with_transport(TransportKind::Tcp)
    .with_deadline(Duration::from_secs(5));
    match liar.post(lie).unwrap().wait().await {
        Err(TransferError::Remote { message, .. }) => {
            assert!(message.contains("is GPU memory: only CUDA IPC reaches it"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    let lie = TransferRequest::new(
        TransferOp::Read,
        "gpu-b",
        vec![Desc::new(liar_host.id(), 0, 4096)],
        vec![Desc::new(gpu.id(), 0, 4096)],
    )
    .with_transport(TransportKind::Tcp)
    .with_deadline(Duration::from_secs(5));
    assert!(matches!(liar.post(lie).unwrap().wait().await, Err(TransferError::Remote { .. })));

    // Without a forced transport: the cuda transport, which refuses it here: without CUDA
    // for that reason, with CUDA because an engine's region registered without the driver
    // has no IPC export.
    match a.post(write(None)) {
        Err(TransferError::NoTransport { reason, .. }) => assert!(
            reason.starts_with("no CUDA: ")
                || reason.contains("not GPU memory exported through CUDA IPC"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_local_transfer_with_a_gpu_region_needs_cuda_and_says_so() {
    let a = agent("gpu-local").await;
    // SAFETY: never dereferenced (see above).
    let gpu = unsafe { a.register_device_unchecked(0x7e00_0000_0000, 1 << 20, 0, false) }.unwrap();
    let host = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    host.fill(0, 1 << 20, 0x42).unwrap();
    let req = TransferRequest::new(
        TransferOp::Write,
        "gpu-local",
        vec![Desc::new(host.id(), 0, 4096)],
        vec![Desc::new(gpu.id(), 0, 4096)],
    );
    match kvfabric::cuda::probe() {
        Err(why) => match a.post(req) {
            Err(TransferError::NoTransport { reason, .. }) => assert_eq!(reason, why.to_string()),
            other => panic!("{other:?}"),
        },
        Ok(_) => eprintln!("this machine has CUDA: the no-CUDA refusal cannot be checked here"),
    }
    // Host memory of the same agent still moves by memcpy.
    let other = a.alloc_region(1 << 20, RegionOptions::default()).unwrap();
    let req = TransferRequest::new(
        TransferOp::Write,
        "gpu-local",
        vec![Desc::new(host.id(), 0, 4096)],
        vec![Desc::new(other.id(), 0, 4096)],
    );
    a.post(req).unwrap().wait().await.unwrap();
    let mut got = vec![0u8; 4096];
    other.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0x42));
}
