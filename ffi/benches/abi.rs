//! The cost of the C ABI: the same store operations through the exported `extern "C"`
//! functions and through the Rust API, interleaved in one run on one store.
//!
//! - lookup of a 128-block prefix (hashing included on both sides);
//! - store (save) of 64 blocks from the caller's paged memory;
//! - load of 64 blocks into the caller's paged memory;
//!
//! with SmolLM2-135M blocks (16 tokens, 368,640 bytes) in vLLM's layout (one K and one V
//! segment per layer: 60 segments of 6 KiB per block), plus the machine's memcpy of the same
//! bytes as the limit. Prints p50/p99 per operation and the ABI/Rust ratio.
//!
//!     cargo bench -p kvfabric-ffi --bench abi

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvfabric::hash::{HashSeed, TokenBlockHasher};
use kvfabric::memory::{copy_between, RegionId};
use kvfabric_ffi::{kvf_agent, kvf_config, kvf_op, kvf_result, kvf_segment, kvf_store};

const LAYERS: u64 = 30;
const BT: usize = 16;
const SEG: u64 = 16 * 3 * 64 * 2; // one layer's K (or V) of one block
const BLOCKS: u32 = 64;
const CACHE_BLOCKS: u64 = 256;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn row(op: &str, rust: &mut [f64], abi: &mut [f64]) {
    let (r50, r99, a50, a99) = (pct(rust, 0.5), pct(rust, 0.99), pct(abi, 0.5), pct(abi, 0.99));
    println!(
        "{op:<28} rust p50 {:>9.1} µs p99 {:>9.1} µs | abi p50 {:>9.1} µs p99 {:>9.1} µs | abi/rust p50 {:.3} p99 {:.3}",
        r50, r99, a50, a99, a50 / r50, a99 / r99
    );
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn wait(op: *mut kvf_op) -> u64 {
    let mut n = 0u64;
    // SAFETY: `op` came from a successful kvf_store_save/load and is freed right after.
    let r = unsafe { kvfabric_ffi::kvf_op_wait(op, kvfabric_ffi::KVF_WAIT_FOREVER, &mut n) };
    assert_eq!(r, kvf_result::KVF_OK);
    // SAFETY: as above; not used again.
    unsafe { kvfabric_ffi::kvf_op_free(op) };
    n
}

fn hasher_for(tokens: &[u32]) -> Vec<kvfabric::hash::SequenceHash> {
    TokenBlockHasher::new(kvfabric::units::BlockTokens::of(BT as u32), HashSeed::DEFAULT)
        .sequence_hashes(tokens)
}

fn main() {
    let mut cfg = kvf_config::default();
    for (k, v) in [
        ("secret", "bench"),
        ("name", "abi-bench"),
        ("model", "smollm2-135m"),
        ("block_tokens", "16"),
        ("host_blocks", "1024"),
        ("shared_host", "false"),
        ("worker_threads", "1"),
    ] {
        cfg.set(k, v).unwrap();
    }
    let agent = kvf_agent::new(&cfg).unwrap();
    let store = kvf_store::new(&agent, &cfg).unwrap();
    let block_bytes = store.store().block_bytes();
    assert_eq!(block_bytes, LAYERS * 2 * SEG);
    let hasher =
        TokenBlockHasher::new(kvfabric::units::BlockTokens::of(BT as u32), HashSeed::DEFAULT);

    // The engine's paged cache: one region per layer, [2][CACHE_BLOCKS][SEG bytes].
    let mut layers: Vec<Vec<u8>> = (0..LAYERS)
        .map(|l| (0..2 * CACHE_BLOCKS * SEG).map(|i| (i * 7 + l) as u8).collect())
        .collect();
    let mut segs = Vec::new();
    let mut regions = Vec::new();
    for buf in &mut layers {
        // SAFETY: the buffers live (unmoved) until the end of main; deregistered there.
        let r = unsafe {
            agent.agent().register_external(
                std::ptr::NonNull::new(buf.as_mut_ptr()).unwrap(),
                buf.len(),
                false,
            )
        }
        .unwrap();
        segs.push(kvf_segment { region: r.id().0, offset: 0, block_stride: SEG, bytes: SEG });
        segs.push(kvf_segment {
            region: r.id().0,
            offset: CACHE_BLOCKS * SEG,
            block_stride: SEG,
            bytes: SEG,
        });
        regions.push(r);
    }
    let seg_regions: Vec<_> =
        segs.iter().map(|s| agent.agent().region(RegionId(s.region)).unwrap()).collect();
    let ids: Vec<u32> = (0..BLOCKS).map(|i| (i * 3) % CACHE_BLOCKS as u32).collect();
    let prompt = |seed: u32, blocks: usize| -> Vec<u32> {
        (0..(blocks * BT) as u32).map(|i| seed.wrapping_mul(2_654_435_761) ^ (i * 31 + 7)).collect()
    };

    // Lookup of a 128-block prefix (stored once, so every lookup hits 128 blocks).
    let long = prompt(1, 128);
    for chunk in 0..2u32 {
        let ids2: Vec<u32> = (0..BLOCKS).collect();
        let op = store.save(&long, (chunk * BLOCKS) as usize, &ids2, &segs).unwrap();
        op.wait(None).unwrap().unwrap();
    }
    let (mut rust, mut abi) = (Vec::new(), Vec::new());
    let mut tiers = vec![0u8; 128];
    for round in 0..20_000 {
        let t = Instant::now();
        let hashes = hasher.sequence_hashes(black_box(&long));
        let hits = store.store().lookup_prefix(&hashes);
        assert_eq!(hits.len(), 128);
        let dr = t.elapsed();
        let t = Instant::now();
        let mut n = 0usize;
        // SAFETY: live store; `long` and `tiers` are valid for their lengths.
        let r = unsafe {
            kvfabric_ffi::kvf_store_lookup(
                &store,
                long.as_ptr(),
                long.len(),
                tiers.as_mut_ptr(),
                tiers.len(),
                &mut n,
            )
        };
        let da = t.elapsed();
        assert_eq!((r, n), (kvf_result::KVF_OK, 128));
        if round >= 1000 {
            rust.push(us(dr));
            abi.push(us(da));
        }
    }
    println!(
        "kvfabric C ABI overhead (SmolLM2-135M blocks: {block_bytes} bytes, {} segments each)",
        segs.len()
    );
    row("lookup 128-block prefix", &mut rust, &mut abi);

    // Save 64 new blocks (a new prompt each round; the host tier evicts the oldest).
    let (mut rust, mut abi, mut limit) = (Vec::new(), Vec::new(), Vec::new());
    let mut scratch = vec![0u8; (BLOCKS as u64 * block_bytes) as usize];
    let src_all: Vec<u8> = layers[0].iter().cycle().take(scratch.len()).copied().collect();
    for round in 0..60u32 {
        let rust_save = |p: Vec<u32>| {
            let t = Instant::now();
            // On the store's runtime, as the ABI's operation runs: the same work, minus
            // the ABI (pointer checks, validation, the op handle and its wait).
            let (st, sg, rg, id) =
                (store.store().clone(), segs.clone(), seg_regions.clone(), ids.clone());
            agent
                .block_on(async {
                    tokio::spawn(async move {
                        let hashes = hasher_for(&p);
                        let mut slots = Vec::new();
                        for (i, h) in hashes.iter().enumerate() {
                            let parent = i.checked_sub(1).map(|j| hashes[j]);
                            slots.push(st.allocate(*h, parent).await.unwrap());
                        }
                        for (k, slot) in slots.into_iter().enumerate() {
                            let mut at = 0;
                            for (s, region) in sg.iter().zip(&rg) {
                                let src = s.offset + u64::from(id[k]) * s.block_stride;
                                copy_between(
                                    region,
                                    src,
                                    slot.region(),
                                    slot.offset() + at,
                                    s.bytes,
                                )
                                .unwrap();
                                at += s.bytes;
                            }
                            slot.commit_unpinned();
                        }
                    })
                    .await
                })
                .unwrap();
            t.elapsed()
        };
        let abi_save = |p: Vec<u32>| {
            let t = Instant::now();
            let mut op = std::ptr::null_mut();
            // SAFETY: live store; arrays valid for their lengths; `op` receives a new op.
            let r = unsafe {
                kvfabric_ffi::kvf_store_save(
                    &store,
                    p.as_ptr(),
                    p.len(),
                    0,
                    ids.as_ptr(),
                    ids.len(),
                    segs.as_ptr(),
                    segs.len(),
                    &mut op,
                )
            };
            assert_eq!(r, kvf_result::KVF_OK);
            assert_eq!(wait(op), u64::from(BLOCKS));
            t.elapsed()
        };
        // Alternate which goes first, so that neither always meets the other's cache state.
        let (p1, p2) =
            (prompt(1000 + 2 * round, BLOCKS as usize), prompt(1001 + 2 * round, BLOCKS as usize));
        let (dr, da) = if round % 2 == 0 {
            let dr = rust_save(p1);
            (dr, abi_save(p2))
        } else {
            let da = abi_save(p1);
            (rust_save(p2), da)
        };
        let t = Instant::now();
        scratch.copy_from_slice(black_box(&src_all));
        let dl = t.elapsed();
        if round >= 5 {
            rust.push(us(dr));
            abi.push(us(da));
            limit.push(us(dl));
        }
    }
    row("save 64 blocks", &mut rust, &mut abi);
    let mem = pct(&mut limit.clone(), 0.5);
    println!(
        "{:<28} memcpy of the same {:.1} MB: p50 {:.1} µs ({:.2} GB/s); abi save reaches {:.2} of it",
        "",
        scratch.len() as f64 / 1e6,
        mem,
        scratch.len() as f64 / mem / 1e3,
        mem / pct(&mut abi, 0.5)
    );

    // Load 64 blocks (held in the host tier) into the cache.
    let held = prompt(77_777, BLOCKS as usize);
    let op = store.save(&held, 0, &ids, &segs).unwrap();
    op.wait(None).unwrap().unwrap();
    drop(op);
    let (mut rust, mut abi) = (Vec::new(), Vec::new());
    let dst_ids: Vec<u32> = ids.iter().map(|i| (i + 1) % CACHE_BLOCKS as u32).collect();
    for round in 0..60 {
        let t = Instant::now();
        let (st, sg, rg, id, h) = (
            store.store().clone(),
            segs.clone(),
            seg_regions.clone(),
            dst_ids.clone(),
            held.clone(),
        );
        agent
            .block_on(async {
                tokio::spawn(async move {
                    let hashes = hasher_for(&h);
                    let refs = st.get(&hashes).await.unwrap();
                    assert_eq!(refs.len(), BLOCKS as usize);
                    for (k, r) in refs.iter().enumerate() {
                        let mut at = 0;
                        for (s, region) in sg.iter().zip(&rg) {
                            let dst = s.offset + u64::from(id[k]) * s.block_stride;
                            copy_between(r.region(), r.offset() + at, region, dst, s.bytes)
                                .unwrap();
                            at += s.bytes;
                        }
                    }
                })
                .await
            })
            .unwrap();
        let dr = t.elapsed();
        let t = Instant::now();
        let mut op = std::ptr::null_mut();
        // SAFETY: as for the save.
        let r = unsafe {
            kvfabric_ffi::kvf_store_load(
                &store,
                held.as_ptr(),
                held.len(),
                0,
                dst_ids.as_ptr(),
                dst_ids.len(),
                segs.as_ptr(),
                segs.len(),
                &mut op,
            )
        };
        assert_eq!(r, kvf_result::KVF_OK);
        assert_eq!(wait(op), u64::from(BLOCKS));
        let da = t.elapsed();
        if round >= 5 {
            rust.push(us(dr));
            abi.push(us(da));
        }
    }
    row("load 64 blocks", &mut rust, &mut abi);

    drop(seg_regions);
    drop(store);
    for r in regions {
        let id = r.id();
        drop(r);
        agent.agent().deregister(id).unwrap();
    }
    drop(layers);
}
