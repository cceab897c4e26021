//! Reading, expanding and measuring Mooncake-format traces: every bad line named, the
//! expansion sharing exactly what the ids share, the limit counted exactly, and the one-pass
//! LRU curve against a plain LRU cache simulated block by block.

use std::collections::VecDeque;
use std::path::PathBuf;

use kvfabric::hash::{HashSeed, TokenBlockHasher};
use kvfabric::rng::SplitMix64;
use kvfabric_planner::trace::{
    Expander, Limit, Reshape, ReuseCurve, TraceError, TraceReader, TraceRequest, LINE_BYTES_MAX,
};

fn read(text: &str, block_tokens: u32) -> Vec<Result<TraceRequest, TraceError>> {
    TraceReader::new(text.as_bytes(), block_tokens).collect()
}

fn line_error(text: &str) -> (u64, String) {
    let all = read(text, 512);
    match all.into_iter().find_map(Result::err) {
        Some(TraceError::Line { line, reason }) => (line, reason),
        other => panic!("expected a line error, got {other:?}"),
    }
}

fn req(timestamp: u64, input_length: u64, hash_ids: &[u64]) -> TraceRequest {
    TraceRequest { timestamp, input_length, output_length: 10, hash_ids: hash_ids.to_vec() }
}

#[test]
fn good_lines_are_read_in_order_and_blank_lines_skipped() {
    let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\
                \n   \n\
                {\"timestamp\": 0, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [1]}\n\
                {\"timestamp\": 7, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [9]}";
    let got: Vec<TraceRequest> = read(text, 512).into_iter().map(Result::unwrap).collect();
    assert_eq!(
        got,
        [
            TraceRequest {
                timestamp: 0,
                input_length: 600,
                output_length: 5,
                hash_ids: vec![1, 2]
            },
            TraceRequest { timestamp: 0, input_length: 512, output_length: 0, hash_ids: vec![1] },
            TraceRequest { timestamp: 7, input_length: 3, output_length: 1, hash_ids: vec![9] },
        ]
    );
}

#[test]
fn every_bad_line_is_named_with_its_reason() {
    let ok = "{\"timestamp\": 5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n";
    let cases: [(&str, &str); 8] = [
        ("{\"timestamp\": 1, \"input_length\": 10", "EOF"),
        ("[1, 2, 3]", "expected struct"),
        ("{\"timestamp\": 6, \"input_length\": 99999999999999999999999, \"output_length\": 1, \"hash_ids\": [1]}", "expected u64"),
        ("{\"timestamp\": 6, \"input_length\": 1000000000000, \"output_length\": 1, \"hash_ids\": [1]}", "not within"),
        ("{\"timestamp\": 6, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}", "not within"),
        ("{\"timestamp\": 6, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": []}", "0 hash_ids for input_length 10"),
        ("{\"timestamp\": 6, \"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [1, 2]}", "needs 3"),
        ("{\"timestamp\": 4, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}", "goes back from 5 ms"),
    ];
    for (bad, why) in cases {
        let (line, reason) = line_error(&format!("{ok}\n{bad}\n{ok}"));
        assert_eq!(line, 3, "{bad}: {reason}");
        assert!(reason.contains(why), "{bad}: {reason:?} should say {why:?}");
    }
    let (line, reason) = line_error(&format!("{ok}\u{0}\u{ff}garbage\n"));
    assert_eq!(line, 2);
    assert!(!reason.is_empty());
    // A line past the bound is refused without reading it whole, and ends the stream.
    let long = format!("{ok}{}\n{ok}", " ".repeat(LINE_BYTES_MAX + 10));
    let all = read(&long, 512);
    assert_eq!(all.len(), 2);
    assert!(
        matches!(&all[1], Err(TraceError::Line { line: 2, reason }) if reason.contains("longer than"))
    );
    // Another block size: the ids must match it.
    assert!(read(
        "{\"timestamp\": 0, \"input_length\": 64, \"output_length\": 1, \"hash_ids\": [1, 2]}",
        32
    )[0]
    .is_ok());
}

#[test]
fn the_expansion_shares_exactly_what_the_ids_share() {
    let x = Expander::new(7);
    let a = x.tokens(&req(0, 1500, &[1, 2, 3]));
    let b = x.tokens(&req(0, 1200, &[1, 2, 4]));
    let c = x.tokens(&req(0, 512, &[2]));
    assert_eq!((a.len(), b.len(), c.len()), (1500, 1200, 512));
    assert_eq!(a[..1024], b[..1024]);
    // The same id gives the same tokens wherever it appears.
    assert_eq!(a[512..1024], c[..]);
    let hasher = TokenBlockHasher::new(kvfabric::units::BlockTokens::of(16), HashSeed::default());
    let (ha, hb) = (hasher.sequence_hashes(&a), hasher.sequence_hashes(&b));
    assert_eq!((ha.len(), hb.len()), (93, 75));
    assert_eq!(ha[..64], hb[..64], "two shared ids are 64 shared kvfabric blocks");
    assert!(ha[64..].iter().zip(&hb[64..]).all(|(x, y)| x != y), "they diverge at block 64");
    // Same seed, same tokens; another seed, others.
    assert_eq!(Expander::new(7).tokens(&req(0, 100, &[1])), a[..100]);
    assert_ne!(Expander::new(8).tokens(&req(0, 100, &[1])), a[..100]);
    assert!(a.iter().all(|&t| t < 32_000));
}

#[test]
fn a_reshaped_trace_keeps_its_sharing_on_shorter_prompts() {
    let r = Reshape { from: 512, to: 32, output_max: 100 };
    let mut a = req(5, 1500, &[1, 2, 3]);
    a.output_length = 400;
    let small = r.apply(a.clone());
    // Two full blocks of 32, and the partial third's share (476 of 512) rounded up: 30.
    assert_eq!(small.input_length, 64 + 30);
    assert_eq!((small.output_length, small.timestamp, &small.hash_ids), (100, 5, &a.hash_ids));
    assert_eq!(r.apply(req(0, 512, &[1])).input_length, 32);
    assert_eq!(r.apply(req(0, 1, &[1])).input_length, 1, "a partial block keeps a token");
    assert_eq!(Reshape::none(512).apply(a.clone()), a);
    // The reshaped prompts share as the ids do, at the new block size.
    let x = Expander { block_tokens: 32, ..Expander::new(7) };
    let b = x.tokens(&r.apply(req(0, 1100, &[1, 2, 4])));
    let t = x.tokens(&small);
    assert_eq!((t.len(), b.len()), (94, 64 + 5));
    assert_eq!(t[..64], b[..64]);
    assert_ne!(t[64..69], b[64..69]);
    // Its limit, counted at the new size, is the same share of blocks.
    let (mut full, mut scaled) = (ReuseCurve::new(512), ReuseCurve::new(32));
    for q in [req(0, 1024, &[1, 2]), req(1, 1536, &[1, 2, 3]), req(2, 1024, &[1, 4])] {
        full.push(&q);
        scaled.push(&r.apply(q));
    }
    assert_eq!(full.limit().block_ratio(), scaled.limit().block_ratio());
    assert_eq!(scaled.limit().reused_tokens, 64 + 32);
}

#[test]
fn the_limit_of_a_hand_made_trace() {
    let trace = [
        req(0, 1500, &[1, 2, 3]),
        req(1, 1100, &[1, 2, 4]),
        req(2, 100, &[5]),
        req(3, 2000, &[1, 2, 3, 6]),
    ];
    let mut curve = ReuseCurve::new(512);
    for r in &trace {
        curve.push(r);
    }
    // Reused: 1,2 of the second (1024 tokens); 1,2,3 of the fourth (1536).
    assert_eq!(
        curve.limit(),
        Limit { requests: 4, blocks: 11, reused_blocks: 5, tokens: 4700, reused_tokens: 2560 }
    );
    assert_eq!(curve.reused_tokens(u64::MAX), 2560);
    assert_eq!(curve.reused_tokens(0), 0);
    // Before request 4, most recent first: 5, 1, 2, 4, 3. With 4 blocks of cache it finds 1
    // and 2 but not 3; with 5, all three.
    assert_eq!(curve.reused_tokens(4), 1024 + 1024);
    assert_eq!(curve.reused_tokens(5), 2560);
    assert_eq!(curve.capacity_for(1.0), Some(5));
    assert_eq!(curve.capacity_for(0.5), Some(2));
}

/// A plain LRU prefix cache of `capacity` blocks, block by block.
fn lru_reference(trace: &[TraceRequest], capacity: usize, bt: u64) -> u64 {
    let mut lru: VecDeque<u64> = VecDeque::new(); // front = most recent
    let mut reused = 0;
    for r in trace {
        for (k, id) in r.hash_ids.iter().enumerate() {
            if !lru.contains(id) {
                break;
            }
            reused += bt.min(r.input_length - k as u64 * bt);
        }
        for id in r.hash_ids.iter().rev() {
            if let Some(p) = lru.iter().position(|x| x == id) {
                lru.remove(p);
            }
            lru.push_front(*id);
            lru.truncate(capacity);
        }
    }
    reused
}

/// Random traces whose ids are prefix-closed, as a trace's are: conversations that grow, and
/// documents shared by several questions.
fn random_trace(seed: u64, n: usize) -> Vec<TraceRequest> {
    let mut rng = SplitMix64(seed);
    let mut convs: Vec<Vec<u64>> = Vec::new();
    let mut next = 0u64;
    let mut out = Vec::new();
    for i in 0..n {
        let pick = rng.next_u64() % 3;
        let mut ids = if pick == 0 || convs.is_empty() {
            Vec::new()
        } else {
            let c = &convs[(rng.next_u64() % convs.len() as u64) as usize];
            c[..1 + (rng.next_u64() % c.len() as u64) as usize].to_vec()
        };
        for _ in 0..1 + rng.next_u64() % 4 {
            ids.push(next);
            next += 1;
        }
        let input = (ids.len() as u64 - 1) * 16 + 1 + rng.next_u64() % 16;
        out.push(TraceRequest {
            timestamp: i as u64,
            input_length: input,
            output_length: 1,
            hash_ids: ids.clone(),
        });
        convs.push(ids);
    }
    out
}

#[test]
fn the_one_pass_curve_is_a_plain_lru_cache_at_every_capacity() {
    for seed in 0..20 {
        let trace = random_trace(seed, 120);
        let mut curve = ReuseCurve::new(16);
        for r in &trace {
            curve.push(r);
        }
        for capacity in [0usize, 1, 2, 3, 5, 8, 13, 21, 40, 80, 1000] {
            assert_eq!(
                curve.reused_tokens(capacity as u64),
                lru_reference(&trace, capacity, 16),
                "seed {seed}, capacity {capacity}"
            );
        }
        assert_eq!(curve.reused_tokens(u64::MAX), curve.limit().reused_tokens);
    }
}

fn shipped(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces").join(name)
}

#[test]
fn the_shipped_traces_read_whole_with_their_published_limits() {
    for (name, requests, limit) in
        [("conversation_trace.jsonl", 12_031, 0.366), ("synthetic_trace.jsonl", 3_993, 0.640)]
    {
        let mut curve = ReuseCurve::new(512);
        for r in TraceReader::open(&shipped(name), 512).unwrap() {
            curve.push(&r.unwrap());
        }
        let l = curve.limit();
        assert_eq!(l.requests, requests, "{name}");
        assert!((l.block_ratio() - limit).abs() < 0.0005, "{name}: {}", l.block_ratio());
    }
}
