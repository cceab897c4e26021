use super::*;

/// The mock engine's time model (prefill 40 µs per token; a decode step 8 ms plus 0.2 µs
/// per token of KV held).
/// 30 requests/s of 2000-token prompts, 128 tokens out, nothing cached.
fn long_prompts() -> Workload {
    Workload { rate: 30.0, isl: 2000.0, osl: 128.0, hit_rate: 0.0, isl_dist: LengthDist::Fixed }
}

/// The prefill workers of a plan's disaggregated layout.
fn prefill_workers(plan: &Plan) -> u32 {
    match plan.disaggregated {
        Need::Disaggregated { prefill, .. } => prefill,
        _ => panic!("{plan:?}"),
    }
}

pub(super) fn mock_profile() -> Profile {
    let prefill = Curve::new(vec![(0.0, 0.0), (8192.0, 8192.0 * 40e-6)]).unwrap();
    let itl = |ctx: f64| {
        Curve::new((1..=64).map(|b| (f64::from(b), 8e-3 + 0.2e-6 * ctx * f64::from(b))).collect())
            .unwrap()
    };
    Profile {
        prefill_s: prefill,
        itl_s: vec![(1024.0, itl(1024.0)), (4096.0, itl(4096.0))],
        batch_max: 64,
        kv_bytes_per_token: 8192,
        restore_s_per_token: 0.0,
    }
}

#[test]
fn curves_interpolate_and_extend() {
    let c = Curve::new(vec![(10.0, 1.0), (0.0, 0.0), (20.0, 3.0)]).unwrap();
    assert_eq!(c.at(5.0), 0.5);
    assert_eq!(c.at(15.0), 2.0);
    assert_eq!(c.at(30.0), 5.0, "past the end: the last segment");
    assert_eq!(c.at(-100.0), 0.0, "never below zero");
    assert!(Curve::new(vec![]).is_none());
    assert!(Curve::new(vec![(0.0, f64::NAN)]).is_none());
}

/// Hand-computed: 2000-token prompts, nothing cached: S = 80 ms. TTFT target 200 ms:
/// ρ ≤ 2(0.2−0.08)/(0.4−0.08) = 0.75; at 30 req/s, 30 × 0.08 / 0.75 = 3.2 → 4 prefill
/// workers. Decode at context 2000 + 64 = 2064, between the curves of 1024 and 4096
/// tokens: interpolated, ITL(b) = 8 ms + 0.2 µs × 2064 × b (exact: the mock's ITL is
/// linear in the context); target 20 ms → b ≤ 29.07 → 29, ITL 19.97 ms, 1452.1 tokens/s
/// per worker; 30 × 128 = 3840 tokens/s → 3 decode workers.
#[test]
fn disaggregated_by_hand() {
    let p = mock_profile();
    let load = long_prompts();
    let plan = plan(&p, &load, &Targets::means(0.2, 0.02));
    let Need::Disaggregated { prefill, decode, kv_bytes_per_s } = plan.disaggregated else {
        panic!("{plan:?}");
    };
    assert_eq!((prefill, decode), (4, 3), "{:#?}", plan.reasons);
    assert_eq!(kv_bytes_per_s, 30.0 * 2000.0 * 8192.0);
    // Half the prompt cached: S = 40 ms, ρ ≤ 2(0.16)/(0.36) = 0.889; 30 × 0.04 / 0.889 =
    // 1.35 → 2.
    let cached = super::plan(&p, &Workload { hit_rate: 0.5, ..load }, &Targets::means(0.2, 0.02));
    assert!(matches!(cached.disaggregated, Need::Disaggregated { prefill: 2, decode: 3, .. }));
}

/// ITL between the contexts measured is interpolated, past the longest extrapolated
/// while it rises, below the shortest the shortest's.
#[test]
fn itl_between_and_beyond_the_contexts_measured() {
    let p = mock_profile();
    let model = |ctx: f64, b: f64| 8e-3 + 0.2e-6 * ctx * b;
    for ctx in [1024.0, 2064.0, 3000.0, 4096.0, 8192.0] {
        let got = p.itl(ctx, 8.0).unwrap();
        assert!((got - model(ctx, 8.0)).abs() < 1e-12, "{ctx}: {got}");
    }
    assert_eq!(p.itl(100.0, 8.0), p.itl(1024.0, 8.0), "below the shortest: its ITL");
    // A profile whose ITL fell with the context (noise): past the longest, the longest's.
    let flat = Curve::new(vec![(1.0, 0.01), (8.0, 0.01)]).unwrap();
    let lower = Curve::new(vec![(1.0, 0.009), (8.0, 0.009)]).unwrap();
    let noisy = Profile { itl_s: vec![(4096.0, lower), (1024.0, flat)], ..p.clone() };
    assert_eq!(noisy.itl(9000.0, 4.0), Some(0.009));
    assert!((noisy.itl(2560.0, 4.0).unwrap() - 0.0095).abs() < 1e-12, "unsorted contexts");
    let none = Profile { itl_s: vec![], ..p };
    assert_eq!(none.itl(1000.0, 1.0), None);
}

#[test]
fn infeasible_targets_say_why() {
    let p = mock_profile();
    let load =
        Workload { rate: 1.0, isl: 8000.0, osl: 16.0, hit_rate: 0.0, isl_dist: LengthDist::Fixed };
    let plan = plan(&p, &load, &Targets::means(0.1, 0.02));
    assert!(
        matches!(&plan.disaggregated, Need::Infeasible(why) if why.contains("exceeds the TTFT target"))
    );
    let plan = super::plan(&p, &Workload { isl: 100.0, ..load }, &Targets::means(0.1, 0.005));
    assert!(
        matches!(&plan.disaggregated, Need::Infeasible(why) if why.contains("no decode batch"))
    );
    assert!(plan.aggregated.workers().is_none());
    assert!(!plan.choose_disaggregated);
}

/// Dynamo's SLA planner (profiled-curve version) on the same inputs: prefill at full
/// utilisation, ⌈λ · ISL / thpt_per_gpu(ISL)⌉ with thpt = ISL / ttft(ISL), i.e. ⌈λS⌉;
/// decode ⌈λ · OSL / best_thpt(ITL target, ISL + OSL/2)⌉. Decode agrees; prefill here is
/// never below Dynamo's and is above it by the queueing the TTFT target needs.
#[test]
fn against_dynamos_formulas() {
    let p = mock_profile();
    for (rate, isl, osl, ttft) in
        [(30.0, 2000.0, 128.0, 0.2), (5.0, 500.0, 256.0, 0.05), (100.0, 1000.0, 64.0, 0.5)]
    {
        let load = Workload { rate, isl, osl, hit_rate: 0.0, isl_dist: LengthDist::Fixed };
        let targets = Targets::means(ttft, 0.02);
        let s = p.prefill_s.at(isl);
        let dynamo_prefill = ((rate * isl / (isl / s)).ceil() as u32).max(1);
        let (b, itl) = p.best_batch(isl + osl / 2.0, targets.itl_s).unwrap();
        let dynamo_decode = ((rate * osl / (f64::from(b) / itl)).ceil() as u32).max(1);
        let ours = plan(&p, &load, &targets);
        let Need::Disaggregated { prefill, decode, .. } = ours.disaggregated else { panic!() };
        assert_eq!(decode, dynamo_decode, "decode is sized alike");
        assert!(prefill >= dynamo_prefill, "{prefill} < {dynamo_prefill}");
        let rho = 2.0 * (ttft - s) / (2.0 * ttft - s);
        assert_eq!(prefill, ((rate * s / rho).ceil() as u32).max(1));
    }
}

/// Short prompts with a long answer: prefill is cheap, decoding dominates; aggregated
/// workers absorb the prefills in their decode steps and need no more workers than a
/// prefill pool plus a decode pool (3 and 1 + 2 here: a tie, which goes to aggregation,
/// moving no KV). Long prompts at a tight ITL: prefill work stretches aggregated decode
/// steps past the target unless each worker decodes almost alone (14 workers), and
/// disaggregation wins (5 + 4).
#[test]
fn the_layout_follows_the_workload() {
    let p = mock_profile();
    let short = plan(
        &p,
        &Workload {
            rate: 20.0,
            isl: 200.0,
            osl: 256.0,
            hit_rate: 0.0,
            isl_dist: LengthDist::Fixed,
        },
        &Targets::means(0.1, 0.02),
    );
    assert!(!short.choose_disaggregated, "{:#?}", short.reasons);
    let long = plan(
        &p,
        &Workload {
            rate: 20.0,
            isl: 4000.0,
            osl: 64.0,
            hit_rate: 0.0,
            isl_dist: LengthDist::Fixed,
        },
        &Targets::means(0.4, 0.0125),
    );
    assert!(long.choose_disaggregated, "{:#?}", long.reasons);
    assert!(long.reasons.last().unwrap().starts_with("disaggregated"));
}

/// Quantile targets: the p99 wait the plan allows is what an M/G/1 queue at the planned
/// utilisation really shows (a Lindley-recursion simulation of 400k arrivals), within
/// 5%; a p99 target leaves less room for queueing than a mean target of the same value,
/// and a p50 target more.
#[test]
fn quantile_targets() {
    use kvfabric::rng::SplitMix64;
    let s = 0.08;
    let fixed = Service { times: vec![s] };
    // Prefills of prompts spread uniformly: 20..140 ms.
    let spread = Service {
        times: LengthDist::Uniform { lo: 500.0, hi: 3500.0 }
            .points(2000.0)
            .into_iter()
            .map(|x| x * 40e-6)
            .collect(),
    };
    assert!((spread.mean() - s).abs() < 1e-9);
    for (svc, ttft, q) in [
        (&fixed, 0.2, 0.99),
        (&fixed, 0.3, 0.99),
        (&fixed, 0.12, 0.9),
        (&fixed, 0.5, 0.99),
        (&spread, 0.4, 0.99),
        (&spread, 0.3, 0.9),
    ] {
        let rho = max_utilisation(svc, ttft, Some(q));
        assert!(rho > 0.05 && rho < 0.95, "{rho}");
        let planned = queue_wait(rho, svc, Some(q));
        assert!((svc.own(Some(q)) + planned - ttft).abs() < 1e-6);
        let rate = rho / svc.mean();
        let mut rng = SplitMix64(7);
        let mut w = 0.0f64;
        let mut waits = Vec::with_capacity(400_000);
        for _ in 0..400_000 {
            waits.push(w);
            let gap = -rng.next_f64().max(1e-300).ln() / rate;
            let service = svc.times[(rng.next_u64() % svc.times.len() as u64) as usize];
            w = (w + service - gap).max(0.0);
        }
        waits.sort_by(f64::total_cmp);
        let simulated = crate::stats::quantile(&waits, q);
        assert!(
                (planned / simulated - 1.0).abs() < 0.05,
                "{} service times, ρ {rho:.3}: planned p{} wait {planned:.4} s, simulated {simulated:.4} s",
                svc.times.len(),
                q * 100.0
            );
        // The mean too (Pollaczek–Khinchine is exact): within the simulation's noise.
        let mean = waits.iter().sum::<f64>() / waits.len() as f64;
        let pk = queue_wait(rho, svc, None);
        assert!((pk / mean - 1.0).abs() < 0.05, "mean wait {pk} against {mean}");
    }
    assert_eq!(queue_wait(0.3, &fixed, Some(0.5)), 0.0, "most requests do not wait at all");
    assert!(max_utilisation(&fixed, 0.2, Some(0.5)) > max_utilisation(&fixed, 0.2, None));
    assert!(max_utilisation(&fixed, 0.2, Some(0.99)) < max_utilisation(&fixed, 0.2, None));
    // Spread prompts wait longer than prompts all of the mean length: a plan of the same
    // mean needs at least as many prefill workers, and says why.
    assert!(max_utilisation(&spread, 0.3, None) < max_utilisation(&fixed, 0.3, None));
    let p = mock_profile();
    let same = long_prompts();
    let spread_load = Workload { isl_dist: LengthDist::Uniform { lo: 500.0, hi: 3500.0 }, ..same };
    let targets = Targets::at_quantile(0.4, 0.02, 0.99);
    let (a, b) = (plan(&p, &same, &targets), plan(&p, &spread_load, &targets));
    assert!(prefill_workers(&b) > prefill_workers(&a), "{:?}\n{:?}", a.reasons, b.reasons);
    assert!(b.reasons[1].contains("500..3500-token prompts"), "{:?}", b.reasons);
    let p = mock_profile();
    let load = long_prompts();
    let mean = plan(&p, &load, &Targets::means(0.2, 0.02));
    let p99 = plan(&p, &load, &Targets::at_quantile(0.2, 0.02, 0.99));
    assert!(prefill_workers(&p99) > prefill_workers(&mean), "{:?} {:?}", p99.reasons, mean.reasons);
    assert!(p99.aggregated.workers() >= mean.aggregated.workers());
    assert!(p99.reasons[0].contains("p99"), "{:?}", p99.reasons);
}

/// The sentences of what_changes name values where the plan really flips: planning at the
/// value named picks the other layout, and the workload's own plan does not.
#[test]
fn what_changes_names_real_flips() {
    let p = mock_profile();
    let load =
        Workload { rate: 20.0, isl: 4000.0, osl: 64.0, hit_rate: 0.0, isl_dist: LengthDist::Fixed };
    let targets = Targets::means(0.4, 0.0125);
    assert_eq!(plan(&p, &load, &targets).layout(), Layout::Disaggregated);
    let lines = what_changes(&p, &load, &targets);
    let prompt = lines
        .iter()
        .find(|l| l.starts_with("at prompts of") && l.contains("or less"))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    assert!(prompt.contains("aggregated wins"), "{prompt}");
    let v: f64 = prompt.split_whitespace().nth(3).unwrap().parse().unwrap();
    assert!(v < 4000.0);
    // The named value is rounded to two digits: the flip holds a little below it.
    let below = plan(&p, &Workload { isl: v * 0.95, ..load }, &targets);
    assert_eq!(below.layout(), Layout::Aggregated, "{prompt}: {:#?}", below.reasons);
    assert_eq!(significant(1234.0), "1200");
    assert_eq!(significant(0.01234), "0.012");
    assert_eq!(significant(5.0), "5.0");
}

#[test]
fn restoring_cached_tokens_costs_what_the_profile_says() {
    let mut p = mock_profile();
    let load =
        Workload { rate: 10.0, isl: 2000.0, osl: 64.0, hit_rate: 0.5, isl_dist: LengthDist::Fixed };
    let free = plan(&p, &load, &Targets::means(0.2, 0.02));
    p.restore_s_per_token = 10e-6;
    let costly = plan(&p, &load, &Targets::means(0.2, 0.02));
    // 1000 computed × 40 µs + 1000 restored × 10 µs = 50 ms.
    assert!(free.reasons[1].ends_with("takes 40.0 ms"), "{:?}", free.reasons);
    assert!(costly.reasons[1].ends_with("takes 50.0 ms"), "{:?}", costly.reasons);
}
