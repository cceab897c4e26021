//! The llama engine: a llama-architecture model from a GGUF file, run on CPU with candle.
//!
//! The linear layers, norms and activations are candle's; attention and rotary embeddings
//! are written out here because the KV cache is ours: each sequence's KV is a block table
//! ([`KvTable`]) in the block store's layout (per block, per layer, K and V rows
//! `[token][kv_heads × head_dim]`, f32), so attention reads cached blocks in place in the
//! store's memory and writes the KV it computes straight into the slots that become stored
//! blocks; a ragged batch (decodes and prefill chunks of different sequences) runs as one
//! matrix per linear layer. Weights stay quantized (fast, approximate) or are dequantized to f32 at load
//! (the default: with f32 weights a prompt computed in one pass and one continued from cached
//! blocks give the same greedy tokens).

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{Device, Module, Tensor};
use kvfabric::layout::{AttentionKind, BlockLayout, KvDtype, KvShape};

use super::{Engine, EngineError, KvBlock, KvTable, ModelInfo, StepInput, TextCodec};

/// How the weights are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Weights {
    /// Dequantized to f32 at load: exact and reproducible, 4× the memory.
    #[default]
    F32,
    /// As stored in the GGUF (Q4_1, Q8_0, ...): faster, approximate.
    Quantized,
}

impl std::str::FromStr for Weights {
    type Err = String;

    /// `f32` or `quantized`, as command lines name them.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Weights::F32),
            "quantized" => Ok(Weights::Quantized),
            _ => Err(format!("unknown weights {s:?} (f32: dequantized at load, exact; quantized: as the GGUF stores them, faster)")),
        }
    }
}

/// Options of [`LlamaEngine::load`].
#[derive(Debug, Clone)]
pub struct LlamaOptions {
    /// Weights in f32 or quantized.
    pub weights: Weights,
    /// Tokens per KV block.
    pub block_tokens: u32,
    /// Cap on the context length (the model's own is used when smaller).
    pub context_max: usize,
    /// A tokenizer.json to use instead of the GGUF's vocabulary.
    pub tokenizer_json: Option<std::path::PathBuf>,
    /// The model id to serve under (default: the file name without `.gguf`).
    pub name: Option<String>,
}

impl Default for LlamaOptions {
    fn default() -> Self {
        LlamaOptions {
            weights: Weights::F32,
            block_tokens: 16,
            context_max: 8192,
            tokenizer_json: None,
            name: None,
        }
    }
}

#[derive(Debug, Clone)]
struct Layer {
    attn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    ffn_norm: Tensor,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
}

/// The llama engine.
#[derive(Debug)]
pub struct LlamaEngine {
    info: ModelInfo,
    codec: TextCodec,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    output: QMatMul,
    n_head: usize,
    n_kv: usize,
    head_dim: usize,
    eps: f32,
    /// cos and sin of every position × frequency, `[pos][head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    seqs: HashMap<u64, KvTable>,
    /// Per layer, the K and V planes' f32 ranges within a block.
    planes: Vec<[std::ops::Range<usize>; 2]>,
    dev: Device,
}

fn model_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::model(e.to_string())
}

impl LlamaEngine {
    /// Loads a GGUF file; `progress(done, total)` is called as tensors load.
    pub fn load(
        path: &Path,
        opts: &LlamaOptions,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        let file = File::open(path)
            .map_err(|e| EngineError::model(format!("opening {}: {e}", path.display())))?;
        let mut r = BufReader::with_capacity(1 << 20, file);
        let content = gguf_file::Content::read(&mut r)
            .map_err(|e| EngineError::model(format!("reading {}: {e}", path.display())))?;
        let md = &content.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" {
            return Err(EngineError::model(format!(
                "architecture {arch:?} is not supported (llama only)"
            )));
        }
        let get_u32 = |k: &str| -> Result<usize, EngineError> {
            md.get(&format!("llama.{k}"))
                .and_then(|v| v.to_u32().ok().or_else(|| v.to_u64().ok().map(|x| x as u32)))
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::model(format!("GGUF lacks llama.{k}")))
        };
        let n_head = get_u32("attention.head_count")?;
        let n_kv = get_u32("attention.head_count_kv").unwrap_or(n_head);
        let n_layer = get_u32("block_count")?;
        let hidden = get_u32("embedding_length")?;
        let ctx = get_u32("context_length").unwrap_or(4096).min(opts.context_max).max(1);
        let eps = md
            .get("llama.attention.layer_norm_rms_epsilon")
            .and_then(|v| v.to_f32().ok())
            .unwrap_or(1e-5);
        let base = md.get("llama.rope.freq_base").and_then(|v| v.to_f32().ok()).unwrap_or(10_000.0);
        if n_head == 0 || n_kv == 0 || hidden % n_head != 0 || n_head % n_kv != 0 {
            return Err(model_err("inconsistent head counts in the GGUF metadata"));
        }
        let head_dim = hidden / n_head;
        if head_dim % 2 != 0 {
            return Err(model_err("odd head dimension"));
        }
        let codec = TextCodec::from_gguf(&content, opts.tokenizer_json.as_deref())?;

        let dev = Device::Cpu;
        let tied = !content.tensor_infos.contains_key("output.weight");
        let total = 2 + usize::from(!tied) + n_layer * 9;
        let mut done = 0;
        let mut tensor = |name: &str| {
            let t = content
                .tensor(&mut r, name, &dev)
                .map_err(|e| EngineError::model(format!("tensor {name}: {e}")));
            done += 1;
            progress(done.min(total), total);
            t
        };
        let mm = |qt: candle_core::quantized::QTensor| -> Result<QMatMul, EngineError> {
            match opts.weights {
                Weights::F32 => {
                    Ok(QMatMul::Tensor(qt.dequantize(&Device::Cpu).map_err(model_err)?))
                }
                Weights::Quantized => QMatMul::from_qtensor(qt).map_err(model_err),
            }
        };
        let embed_q = tensor("token_embd.weight")?;
        let embed = embed_q.dequantize(&dev).map_err(model_err)?;
        let norm = tensor("output_norm.weight")?.dequantize(&dev).map_err(model_err)?;
        let output = match !tied {
            true => mm(tensor("output.weight")?)?,
            false => {
                // Tied to the embeddings.
                match opts.weights {
                    Weights::F32 => QMatMul::Tensor(embed.clone()),
                    Weights::Quantized => QMatMul::from_qtensor(embed_q).map_err(model_err)?,
                }
            }
        };
        let mut layers = Vec::with_capacity(n_layer);
        for i in 0..n_layer {
            let p = format!("blk.{i}");
            let mut t = |n: &str| tensor(&format!("{p}.{n}.weight"));
            layers.push(Layer {
                attn_norm: t("attn_norm")?.dequantize(&dev).map_err(model_err)?,
                wq: mm(t("attn_q")?)?,
                wk: mm(t("attn_k")?)?,
                wv: mm(t("attn_v")?)?,
                wo: mm(t("attn_output")?)?,
                ffn_norm: t("ffn_norm")?.dequantize(&dev).map_err(model_err)?,
                w_gate: mm(t("ffn_gate")?)?,
                w_up: mm(t("ffn_up")?)?,
                w_down: mm(t("ffn_down")?)?,
            });
        }
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(ctx * half);
        let mut sin = Vec::with_capacity(ctx * half);
        let freqs: Vec<f32> =
            (0..half).map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32)).collect();
        for pos in 0..ctx {
            for f in &freqs {
                let a = pos as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let kv = KvShape {
            num_layers: n_layer as u32,
            attention: AttentionKind::Mha { num_kv_heads: n_kv as u32, head_dim: head_dim as u32 },
            dtype: KvDtype::F32,
        };
        let layout = BlockLayout::new(kv, opts.block_tokens).map_err(model_err)?;
        let mut planes = Vec::with_capacity(n_layer);
        for l in 0..n_layer as u32 {
            let plane = |p: u32| {
                layout
                    .plane_range(l, p)
                    .map(|r| r.start as usize / 4..r.end as usize / 4)
                    .ok_or(model_err("bad layout"))
            };
            planes.push([plane(0)?, plane(1)?]);
        }
        let id = opts.name.clone().unwrap_or_else(|| {
            let stem = path.file_name().and_then(|s| s.to_str()).unwrap_or("model");
            stem.strip_suffix(".gguf").unwrap_or(stem).to_string()
        });
        Ok(LlamaEngine {
            info: ModelInfo { id, context_len: ctx, layout },
            codec,
            embed,
            layers,
            norm,
            output,
            n_head,
            n_kv,
            head_dim,
            eps,
            cos,
            sin,
            seqs: HashMap::new(),
            planes,
            dev,
        })
    }

    /// Another engine over the same weights (shared, not copied), with no sequences.
    pub fn share_weights(&self) -> LlamaEngine {
        LlamaEngine {
            info: self.info.clone(),
            codec: self.codec.clone(),
            embed: self.embed.clone(),
            layers: self.layers.clone(),
            norm: self.norm.clone(),
            output: self.output.clone(),
            n_head: self.n_head,
            n_kv: self.n_kv,
            head_dim: self.head_dim,
            eps: self.eps,
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            seqs: HashMap::new(),
            planes: self.planes.clone(),
            dev: self.dev.clone(),
        }
    }

    fn width(&self) -> usize {
        self.n_kv * self.head_dim
    }

    /// Rotates every head of `rows` (`[token][heads × head_dim]`) by its token's position
    /// (interleaved pairs, as GGUF llama weights expect).
    fn rope(&self, rows: &mut [f32], positions: &[usize], heads: usize) {
        let (hd, half) = (self.head_dim, self.head_dim / 2);
        for (row, &pos) in rows.chunks_exact_mut(heads * hd).zip(positions) {
            let (c, s) = (&self.cos[pos * half..][..half], &self.sin[pos * half..][..half]);
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half {
                    let (x0, x1) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = x0 * c[i] - x1 * s[i];
                    head[2 * i + 1] = x0 * s[i] + x1 * c[i];
                }
            }
        }
    }

    /// Causal attention of `q` (`[n][heads × head_dim]`, positions `start..start+n`) over
    /// the first `start + n` rows of K and V, held `block_tokens` rows per block (`k[b]`,
    /// `v[b]`: block `b`'s plane of the layer); writes `[n][heads × head_dim]` into `out`.
    fn attend(&self, q: &[f32], k: &[&[f32]], v: &[&[f32]], start: usize, out: &mut [f32]) {
        let (hd, nh, w) = (self.head_dim, self.n_head, self.width());
        let bt = self.info.layout.block_tokens.as_usize();
        let group = nh / self.n_kv;
        let scale = 1.0 / (hd as f32).sqrt();
        let n = q.len() / (nh * hd);
        let work = |(idx, o): (usize, &mut [f32])| {
            let (i, h) = (idx / nh, idx % nh);
            let g = h / group;
            let qh = &q[(i * nh + h) * hd..][..hd];
            let len = start + i + 1;
            let krow = |t: usize| &k[t / bt][(t % bt) * w + g * hd..][..hd];
            let vrow = |t: usize| &v[t / bt][(t % bt) * w + g * hd..][..hd];
            let mut scores: Vec<f32> = (0..len).map(|t| dot(qh, krow(t)) * scale).collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for s in &mut scores {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (t, &p) in scores.iter().enumerate() {
                let p = p / sum;
                for (a, b) in o.iter_mut().zip(vrow(t)) {
                    *a += p * b;
                }
            }
        };
        if n * (start + n) * nh >= 1 << 16 {
            use rayon::prelude::*;
            out.par_chunks_mut(hd).enumerate().for_each(work);
        } else {
            out.chunks_mut(hd).enumerate().for_each(work);
        }
    }

    /// Writes the K and V rows of `n` tokens from `start` into layer `l`'s planes of the
    /// sequence's blocks.
    fn write_kv(
        table: &mut KvTable,
        plane: &[std::ops::Range<usize>; 2],
        (bt, w): (usize, usize),
        start: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        for (j, (kr, vr)) in k.chunks_exact(w).zip(v.chunks_exact(w)).enumerate() {
            let p = start + j;
            let block = table.blocks.get_mut(p / bt).ok_or(model_err("KV block missing"))?;
            let f = block.f32s_mut()?.ok_or(model_err("a step would write a cached block"))?;
            let at = (p % bt) * w;
            f[plane[0].start + at..][..w].copy_from_slice(kr);
            f[plane[1].start + at..][..w].copy_from_slice(vr);
        }
        Ok(())
    }
}

/// The model run the plain candle way, for comparison: batch 1, a per-layer KV cache of
/// tensors grown by concatenation, attention by `matmul` with a causal mask and softmax,
/// candle's interleaved rotary kernel. Shares the engine's weights.
#[derive(Debug)]
pub struct ReferenceLoop<'a> {
    m: &'a LlamaEngine,
    cache: Vec<Option<(Tensor, Tensor)>>,
    pos: usize,
}

impl<'a> ReferenceLoop<'a> {
    /// An empty sequence.
    pub fn new(m: &'a LlamaEngine) -> Self {
        ReferenceLoop { m, cache: vec![None; m.layers.len()], pos: 0 }
    }

    /// Feeds `tokens` (all at once) and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.forward_inner(tokens).map_err(model_err)
    }

    fn forward_inner(&mut self, tokens: &[u32]) -> candle_core::Result<Vec<f32>> {
        let m = self.m;
        let (t, p, nh, nkv, hd) = (tokens.len(), self.pos, m.n_head, m.n_kv, m.head_dim);
        let half = hd / 2;
        let dev = &m.dev;
        let ids = Tensor::from_slice(tokens, t, dev)?;
        let mut x = m.embed.index_select(&ids, 0)?.unsqueeze(0)?;
        let cos = Tensor::from_slice(&m.cos[p * half..(p + t) * half], (t, half), dev)?;
        let sin = Tensor::from_slice(&m.sin[p * half..(p + t) * half], (t, half), dev)?;
        let len = p + t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..len).map(move |j| if j > p + i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, len), dev)?;
        for (l, layer) in m.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, m.eps)?;
            let heads = |w: &QMatMul, n: usize| -> candle_core::Result<Tensor> {
                w.forward(&h)?.reshape((1, t, n, hd))?.transpose(1, 2)?.contiguous()
            };
            let q = candle_nn::rotary_emb::rope_i(&heads(&layer.wq, nh)?, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope_i(&heads(&layer.wk, nkv)?, &cos, &sin)?;
            let v = heads(&layer.wv, nkv)?;
            let (k, v) = match &self.cache[l] {
                Some((ck, cv)) => (Tensor::cat(&[ck, &k], 2)?, Tensor::cat(&[cv, &v], 2)?),
                None => (k, v),
            };
            self.cache[l] = Some((k.clone(), v.clone()));
            let rep = |x: &Tensor| -> candle_core::Result<Tensor> {
                x.unsqueeze(2)?.expand((1, nkv, nh / nkv, len, hd))?.reshape((1, nh, len, hd))
            };
            let att = (q.matmul(&rep(&k)?.t()?)? / (hd as f64).sqrt())?;
            let att = candle_nn::ops::softmax_last_dim(&att.broadcast_add(&mask)?)?;
            let y = att.matmul(&rep(&v)?)?.transpose(1, 2)?.reshape((1, t, nh * hd))?;
            x = (x + layer.wo.forward(&y)?)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, m.eps)?;
            let g = layer.w_gate.forward(&h)?.silu()?;
            x = (&x + layer.w_down.forward(&(g * layer.w_up.forward(&h)?)?)?)?;
        }
        self.pos += t;
        let last = x.narrow(1, t - 1, 1)?.reshape((1, x.dim(2)?))?;
        let last = candle_nn::ops::rms_norm(&last, &m.norm, m.eps)?;
        m.output.forward(&last)?.flatten_all()?.to_vec1::<f32>()
    }
}

/// Dot product with eight accumulators (vectorizes; a fixed order, so reproducible).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

impl Engine for LlamaEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn codec(&self) -> &TextCodec {
        &self.codec
    }

    fn add_sequence(&mut self, seq: u64) {
        self.seqs.insert(seq, KvTable::default());
    }

    fn remove_sequence(&mut self, seq: u64) {
        self.seqs.remove(&seq);
    }

    fn push_cached(&mut self, seq: u64, block: KvBlock) -> Result<(), EngineError> {
        let layout = self.info.layout;
        if block.bytes().len() as u64 != layout.bytes_per_block() {
            return Err(EngineError::invalid("block of a wrong size"));
        }
        block.f32s()?;
        let s = self.seqs.get_mut(&seq).ok_or(EngineError::invalid("unknown sequence"))?;
        s.push_cached(layout.block_tokens.as_usize(), block)
    }

    fn table(&self, seq: u64) -> Option<&KvTable> {
        self.seqs.get(&seq)
    }

    fn table_mut(&mut self, seq: u64) -> Option<&mut KvTable> {
        self.seqs.get_mut(&seq)
    }

    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        let ctx = self.info.context_len;
        let (bt, bytes) =
            (self.info.layout.block_tokens.as_usize(), self.info.layout.bytes_per_block() as usize);
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for (i, input) in batch.iter().enumerate() {
            let s = self.seqs.get(&input.seq).ok_or(EngineError::invalid("unknown sequence"))?;
            if s.len != input.start || input.start + input.tokens.len() > ctx {
                return Err(EngineError::invalid(format!(
                    "step at position {} of a sequence holding {} tokens",
                    input.start, s.len
                )));
            }
            if batch[..i].iter().any(|b| b.seq == input.seq) {
                return Err(EngineError::invalid("a sequence twice in one step"));
            }
            ids.extend_from_slice(input.tokens);
            positions.extend(input.start..input.start + input.tokens.len());
        }
        let total = ids.len();
        if total == 0 {
            return Ok(Vec::new());
        }
        for input in batch {
            if let Some(s) = self.seqs.get_mut(&input.seq) {
                s.reserve_owned(bt, input.start + input.tokens.len(), bytes);
            }
        }
        let (nh, hd, w) = (self.n_head, self.head_dim, self.width());
        let ids_t = Tensor::from_vec(ids, total, &self.dev).map_err(model_err)?;
        let mut x = self.embed.index_select(&ids_t, 0).map_err(model_err)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, self.eps).map_err(model_err)?;
            let flat = |m: &QMatMul| -> Result<Vec<f32>, EngineError> {
                m.forward(&h).and_then(|t| t.flatten_all()?.to_vec1::<f32>()).map_err(model_err)
            };
            let mut q = flat(&layer.wq)?;
            let mut k = flat(&layer.wk)?;
            let v = flat(&layer.wv)?;
            self.rope(&mut q, &positions, nh);
            self.rope(&mut k, &positions, self.n_kv);
            let plane = &self.planes[l];
            let mut row = 0;
            for input in batch {
                let n = input.tokens.len();
                let s = self.seqs.get_mut(&input.seq).ok_or(model_err("sequence vanished"))?;
                let (kr, vr) = (&k[row * w..(row + n) * w], &v[row * w..(row + n) * w]);
                Self::write_kv(s, plane, (bt, w), input.start, kr, vr)?;
                row += n;
            }
            let mut attn = vec![0f32; total * nh * hd];
            let mut row = 0;
            for input in batch {
                let n = input.tokens.len();
                let s = &self.seqs[&input.seq];
                let blocks = &s.blocks[..(input.start + n).div_ceil(bt)];
                let mut kp = Vec::with_capacity(blocks.len());
                let mut vp = Vec::with_capacity(blocks.len());
                for b in blocks {
                    let f = b.f32s()?;
                    kp.push(&f[plane[0].clone()]);
                    vp.push(&f[plane[1].clone()]);
                }
                self.attend(
                    &q[row * nh * hd..(row + n) * nh * hd],
                    &kp,
                    &vp,
                    input.start,
                    &mut attn[row * nh * hd..(row + n) * nh * hd],
                );
                row += n;
            }
            let attn = Tensor::from_vec(attn, (total, nh * hd), &self.dev).map_err(model_err)?;
            let o = layer.wo.forward(&attn).map_err(model_err)?;
            x = (x + o).map_err(model_err)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, self.eps).map_err(model_err)?;
            let gate = layer.w_gate.forward(&h).and_then(|g| g.silu()).map_err(model_err)?;
            let up = layer.w_up.forward(&h).map_err(model_err)?;
            let down = layer.w_down.forward(&(gate * up).map_err(model_err)?).map_err(model_err)?;
            x = (x + down).map_err(model_err)?;
        }
        for input in batch {
            if let Some(s) = self.seqs.get_mut(&input.seq) {
                s.len += input.tokens.len();
            }
        }
        // Logits of the last token of each input that asks for them.
        let mut rows = Vec::new();
        let mut end = 0u32;
        for input in batch {
            end += input.tokens.len() as u32;
            if input.logits {
                rows.push(end - 1);
            }
        }
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let rows_t = Tensor::from_vec(rows.clone(), rows.len(), &self.dev).map_err(model_err)?;
        let last = x.index_select(&rows_t, 0).map_err(model_err)?;
        let last = candle_nn::ops::rms_norm(&last, &self.norm, self.eps).map_err(model_err)?;
        let logits = self.output.forward(&last).map_err(model_err)?;
        logits.to_vec2::<f32>().map_err(model_err)
    }
}
