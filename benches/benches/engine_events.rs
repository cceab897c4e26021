//! Decoding engines' KV events (vLLM's msgpack as vLLM 0.32 encodes it: a positional batch of
//! maps tagged by "type"), and mapping them to kvfabric's sequence hashes. Throughput in
//! blocks per second on one core (the goal: at least 1M blocks/s).
//!
//! `cargo bench -p kvfabric-benches --bench engine_events`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvfabric_attach::engine::msgpack::Writer;
use kvfabric_attach::engine::{decode_batch, EngineMirror, Flavor};

/// A batch of `events` BlockStored events of `blocks` blocks of 16 tokens, each chain the
/// child of the previous one, hashes above 2^63 as vLLM's often are.
fn batch(first_hash: u64, events: usize, blocks: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.array(3).float(1.7e9).array(events);
    let mut h = first_hash;
    let mut token = 0u64;
    for e in 0..events {
        w.map(11).str("type").str("BlockStored").str("block_hashes").array(blocks);
        for _ in 0..blocks {
            w.uint(h);
            h = h.wrapping_add(0x9e37_79b9_7f4a_7c15);
        }
        w.str("parent_block_hash");
        if e == 0 {
            w.nil();
        } else {
            w.uint(h.wrapping_sub(0x9e37_79b9_7f4a_7c15 * (blocks as u64 + 1)));
        }
        w.str("token_ids").array(blocks * 16);
        for _ in 0..blocks * 16 {
            w.uint(token % 50_000);
            token += 7919;
        }
        w.str("block_size").uint(16).str("lora_id").nil().str("medium").str("GPU");
        w.str("lora_name").nil().str("extra_keys").array(blocks);
        for _ in 0..blocks {
            w.nil();
        }
        w.str("group_idx").uint(0).str("kv_cache_spec_kind").str("full_attention");
    }
    w.uint(0);
    w.buf
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("engine_events");
    for (events, blocks) in [(1usize, 16usize), (16, 16), (64, 4)] {
        let payload = batch(u64::MAX / 3, events, blocks);
        g.throughput(Throughput::Elements((events * blocks) as u64));
        g.bench_function(format!("decode/{events}x{blocks}"), |b| {
            b.iter(|| decode_batch(&payload, Flavor::Vllm).unwrap())
        });
        // Decoding and mapping to kvfabric hashes into a mirror that already holds ~100k
        // blocks (a warm engine); each iteration stores fresh hashes.
        let mut mirror = EngineMirror::new(kvfabric::units::BlockTokens::of(16));
        let mut out = Vec::new();
        for i in 0..(100_000 / (events * blocks)).max(1) {
            let warm =
                decode_batch(&batch(i as u64 * 1_000_003, events, blocks), Flavor::Vllm).unwrap();
            mirror.apply(&warm, &mut out);
            out.clear();
        }
        let mut n = 0u64;
        g.bench_function(format!("decode+map/{events}x{blocks}"), |b| {
            b.iter_batched(
                || {
                    n += 1;
                    batch(u64::MAX / 2 + n * 1_000_000_007, events, blocks)
                },
                |p| {
                    let batch = decode_batch(&p, Flavor::Vllm).unwrap();
                    mirror.apply(&batch, &mut out);
                    out.clear();
                    if mirror.len() > 200_000 {
                        // Bounded memory over millions of iterations; rare, amortized.
                        let _ = mirror.clear();
                    }
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
