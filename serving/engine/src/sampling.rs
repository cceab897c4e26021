//! Next-token choice: greedy (temperature 0) or seeded sampling with temperature and top-p.

pub use kvfabric::contract::generate::SamplingParams;

/// A sampler for one sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Sampler { params, rng: SplitMix64(params.seed), scratch: Vec::new() }
    }

    /// The next token from logits (non-finite logits are never chosen).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().filter(|x| x.is_finite()).fold(f32::MIN, f32::max);
        self.scratch.clear();
        let mut sum = 0f64;
        for (i, &l) in logits.iter().enumerate() {
            if l.is_finite() {
                let p = ((l - max) / t).exp();
                sum += f64::from(p);
                self.scratch.push((p, i as u32));
            }
        }
        if self.scratch.is_empty() || sum <= 0.0 {
            return argmax(logits);
        }
        let mut total = sum;
        if self.params.top_p < 1.0 {
            // Most likely first; ties by id so that the order is deterministic.
            self.scratch.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let cut = sum * f64::from(self.params.top_p.max(0.0));
            let mut acc = 0f64;
            let mut keep = self.scratch.len();
            for (i, (p, _)) in self.scratch.iter().enumerate() {
                acc += f64::from(*p);
                if acc >= cut {
                    keep = i + 1;
                    break;
                }
            }
            self.scratch.truncate(keep.max(1));
            total = self.scratch.iter().map(|(p, _)| f64::from(*p)).sum();
        }
        let mut r = self.rng.next_f64() * total;
        for &(p, id) in &self.scratch {
            r -= f64::from(p);
            if r <= 0.0 {
                return id;
            }
        }
        self.scratch.last().map_or(0, |&(_, id)| id)
    }
}

/// Index of the largest finite logit, the lowest index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = (f32::NEG_INFINITY, 0u32);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.0 {
            best = (l, i as u32);
        }
    }
    best.1
}

/// The generator sampling draws from (defined with kvfabric's other seeded draws).
pub use kvfabric::rng::SplitMix64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_and_the_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let p = SamplingParams { temperature: 1.0, top_p: 1.0, seed: 7 };
        let logits = [0.0f32, (3.0f32).ln(), f32::NEG_INFINITY];
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..p });
            (0..4000).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        let d = draw(7);
        assert!(!d.contains(&2), "a -inf logit was sampled");
        let ones = d.iter().filter(|&&t| t == 1).count() as f64 / d.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "P(1) = {ones}, expected 0.75");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_p: 0.5, seed: 1 });
        // P = [0.6, 0.3, 0.1]: the nucleus at 0.5 is token 0 alone.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        assert!((0..500).all(|_| s.sample(&logits) == 0));
    }
}
