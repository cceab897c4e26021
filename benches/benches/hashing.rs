//! Token-block hashing throughput (tokens/s) against raw XXH3 over the same bytes, measured in
//! the same run.
//!
//! - `raw_xxh3_per_block`: XXH3-64 over each block's 64 bytes, nothing else: the bound for
//!   hashing blocks one at a time, as any block-keyed cache must.
//! - `raw_xxh3_whole_buffer`: one XXH3-64 call over all the bytes: the streaming bound, which
//!   no per-block scheme can reach on short blocks (per-call setup and finalization).
//! - `block_hashes`: kvfabric's block hashes (`TokenBlockHasher::block_hashes`).
//! - `block_and_sequence_hashes`: block hashes plus the chained sequence hashes, what
//!   kvfabric computes for every request (`TokenBlockHasher::for_each_block`).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvfabric::hash::{HashSeed, TokenBlockHasher};
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn hashing(c: &mut Criterion) {
    for &(tokens_n, block_tokens) in &[(4096usize, 16usize), (131_072, 16), (4096, 64)] {
        let tokens: Vec<u32> =
            (0..tokens_n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 128_256).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let hasher = TokenBlockHasher::new(
            kvfabric::units::BlockTokens::of(block_tokens as u32),
            HashSeed::DEFAULT,
        );
        let mut g = c.benchmark_group(format!("hash/{tokens_n}tok/bs{block_tokens}"));
        g.throughput(Throughput::Elements(tokens_n as u64));
        g.bench_function("raw_xxh3_per_block", |b| {
            b.iter(|| {
                let mut acc = 0u64;
                for chunk in black_box(&bytes).chunks_exact(block_tokens * 4) {
                    acc ^= xxh3_64_with_seed(chunk, 1337);
                }
                acc
            })
        });
        g.bench_function("raw_xxh3_whole_buffer", |b| {
            b.iter(|| xxh3_64_with_seed(black_box(&bytes), 1337))
        });
        g.bench_function("block_hashes", |b| b.iter(|| hasher.block_hashes(black_box(&tokens))));
        g.bench_function("block_and_sequence_hashes", |b| {
            b.iter(|| {
                let mut acc = 0u64;
                hasher.for_each_block(black_box(&tokens), |_, s| acc ^= s.0);
                acc
            })
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = hashing
}
criterion_main!(benches);
