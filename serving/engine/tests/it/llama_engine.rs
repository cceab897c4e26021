//! The llama engine against the plain candle loop on the real model (f32 weights): the same
//! greedy tokens and nearly the same logits; batching sequences together changes nothing;
//! KV exported to blocks and imported into another sequence continues exactly.

use std::path::PathBuf;

use kvfabric_engine::llama::{LlamaEngine, LlamaOptions, ReferenceLoop};
use kvfabric_engine::sampling::argmax;
use kvfabric_engine::{ChatMessage, Engine, StepInput};

fn load() -> LlamaEngine {
    let path = std::env::var_os("KVFABRIC_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").expect("HOME is set");
        PathBuf::from(home).join(".cache/kvfabric/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    LlamaEngine::load(&path, &LlamaOptions::default(), |_, _| {}).expect("load the model")
}

fn prompt(e: &LlamaEngine, question: &str) -> Vec<u32> {
    let text = e
        .codec()
        .render_chat(&[ChatMessage { role: "user".into(), content: question.into() }])
        .unwrap();
    e.codec().encode(&text).unwrap()
}

/// Greedy tokens from the engine, one sequence, prompt in one step.
fn engine_greedy(e: &mut LlamaEngine, seq: u64, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    e.add_sequence(seq);
    let first = e.step(&[StepInput { seq, start: 0, tokens: prompt, logits: true }]).unwrap();
    let mut out = vec![argmax(&first[0])];
    while out.len() < n {
        let pos = prompt.len() + out.len() - 1;
        let l =
            e.step(&[StepInput { seq, start: pos, tokens: &out[out.len() - 1..], logits: true }]);
        out.push(argmax(&l.unwrap()[0]));
    }
    e.remove_sequence(seq);
    (out, first.into_iter().next().unwrap())
}

#[test]
fn engine_matches_the_plain_candle_loop_and_is_batch_and_cache_invariant() {
    let mut e = load();
    let p = prompt(&e, "Write one sentence about the sea.");
    let n = 24;

    let mut r = ReferenceLoop::new(&e);
    let ref_first = r.forward(&p).unwrap();
    let mut want = vec![argmax(&ref_first)];
    while want.len() < n {
        let l = r.forward(&want[want.len() - 1..]).unwrap();
        want.push(argmax(&l));
    }
    let (got, first) = engine_greedy(&mut e, 1, &p, n);
    assert_eq!(got, want, "greedy tokens differ from the plain candle loop");
    let max_diff = first.iter().zip(&ref_first).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(max_diff < 1e-3, "first logits differ by {max_diff}");

    // Two sequences in the same steps (prompt chunks of different lengths, then decodes) give
    // what each gives alone.
    let q = prompt(&e, "Name three colors.");
    let (alone_q, _) = engine_greedy(&mut e, 2, &q, 8);
    e.add_sequence(3);
    e.add_sequence(4);
    let l = e
        .step(&[
            StepInput { seq: 3, start: 0, tokens: &p, logits: true },
            StepInput { seq: 4, start: 0, tokens: &q, logits: true },
        ])
        .unwrap();
    let (mut a, mut b) = (vec![argmax(&l[0])], vec![argmax(&l[1])]);
    for _ in 1..8 {
        let (pa, pb) = (p.len() + a.len() - 1, q.len() + b.len() - 1);
        let l = e
            .step(&[
                StepInput { seq: 3, start: pa, tokens: &a[a.len() - 1..], logits: true },
                StepInput { seq: 4, start: pb, tokens: &b[b.len() - 1..], logits: true },
            ])
            .unwrap();
        a.push(argmax(&l[0]));
        b.push(argmax(&l[1]));
    }
    assert_eq!(a, want[..8]);
    assert_eq!(b, alone_q);

    // Export sequence 3's full blocks, import them into a new sequence, compute only the rest.
    let bt = e.info().layout.block_tokens.as_usize();
    let bytes = e.info().layout.bytes_per_block() as usize;
    let full = (p.len() - 1) / bt;
    assert!(full >= 2, "prompt too short for this test: {} tokens", p.len());
    let blocks: Vec<Vec<u8>> = (0..full)
        .map(|i| {
            let mut b = vec![0u8; bytes];
            e.export_block(3, i, &mut b).unwrap();
            b
        })
        .collect();
    e.add_sequence(5);
    for (i, b) in blocks.iter().enumerate() {
        e.import_block(5, i, b).unwrap();
    }
    let l =
        e.step(&[StepInput { seq: 5, start: full * bt, tokens: &p[full * bt..], logits: true }]);
    assert_eq!(argmax(&l.unwrap()[0]), want[0]);
    // Bad calls are errors, not panics.
    assert!(e.import_block(5, 0, &blocks[0]).is_err(), "out of order");
    assert!(e.export_block(5, 99, &mut vec![0u8; bytes]).is_err());
    assert!(e.step(&[StepInput { seq: 99, start: 0, tokens: &[1], logits: true }]).is_err());
    assert!(e.step(&[StepInput { seq: 5, start: 3, tokens: &[1], logits: true }]).is_err());
}
