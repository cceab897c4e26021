use super::*;
use crate::sla::Curve;

fn mock_profile() -> Profile {
    let itl = |ctx: f64| {
        Curve::new((1..=8).map(|b| (f64::from(b), 8e-3 + 0.2e-6 * ctx * f64::from(b))).collect())
            .unwrap()
    };
    Profile {
        prefill_s: Curve::new(vec![(0.0, 0.0), (4096.0, 4096.0 * 40e-6)]).unwrap(),
        itl_s: vec![(512.0, itl(512.0)), (2048.0, itl(2048.0))],
        batch_max: 8,
        kv_bytes_per_token: 8192,
        restore_s_per_token: 0.0,
    }
}

fn cfg() -> PlannerConfig {
    PlannerConfig {
        interval: Duration::from_secs(10),
        min_workers: 1,
        workers_max: 8,
        targets: Targets::at_quantile(0.3, 0.05, 0.99),
        predictor: Predictor::Constant,
        profile: mock_profile(),
        scale_down_after: 2,
        scale_down_headroom: 0.0,
        history: 8,
    }
}

fn window(rate: f64, ttft: f64) -> LoadWindow {
    let n = (rate * 10.0) as u64;
    LoadWindow {
        duration: Duration::from_secs(10),
        arrivals: n,
        requests: n,
        counted: n,
        errors: 0,
        prompt_tokens: n * 512,
        generated_tokens: n * 64,
        cached_tokens: 0,
        ttft_s: vec![ttft; n as usize],
        itl_s: vec![0.009; n as usize * 63],
        prompt_lens: vec![512.0; n as usize],
        classes: Vec::new(),
    }
}

/// One class's part of a window: `rate` req/s of `isl`-token prompts (`hit` cached) and
/// 16-token answers, at TTFT `ttft`.
fn class_window(name: &str, target: f64, rate: f64, isl: u64, hit: f64, ttft: f64) -> ClassWindow {
    let n = (rate * 10.0) as u64;
    ClassWindow {
        name: name.into(),
        ttft_target_s: Some(target),
        itl_target_s: None,
        arrivals: n,
        counted: n,
        prompt_tokens: n * isl,
        generated_tokens: n * 16,
        cached_tokens: (n as f64 * isl as f64 * hit) as u64,
        ttft_s: vec![ttft; n as usize],
    }
}

/// With classes in the window, an aggregated pool is planned so that each class meets
/// its own target served by urgency: the workers `plan_classes` names for the predicted
/// mix (not the one set of targets); a class over its own target adds a worker and says
/// which.
#[test]
fn classes_plan_each_class_to_its_own_target() {
    let interactive = class_window("interactive", 0.3, 2.0, 440, 0.9, 0.05);
    let batch = class_window("batch", 30.0, 8.0, 4096, 0.0, 2.0);
    let mut w = window(10.0, 0.5);
    w.classes = vec![interactive.clone(), batch.clone()];
    let mut tight = cfg();
    tight.targets = Targets::at_quantile(0.3, 0.05, 0.99);
    tight.workers_max = 64;
    let d = Brain::new(tight.clone()).decide(&w, 1);
    let loads = [
        ClassLoad {
            name: "batch".into(),
            load: Workload {
                rate: 8.0,
                isl: 4096.0,
                osl: 16.0,
                hit_rate: 0.0,
                isl_dist: LengthDist::Fixed,
            },
            targets: Targets::at_quantile(30.0, f64::INFINITY, 0.99),
        },
        ClassLoad {
            name: "interactive".into(),
            load: Workload {
                rate: 2.0,
                isl: 440.0,
                osl: 16.0,
                hit_rate: 0.9,
                isl_dist: LengthDist::Fixed,
            },
            targets: Targets::at_quantile(0.3, f64::INFINITY, 0.99),
        },
    ];
    let want = plan_classes(&tight.profile, &loads).with_classes.unwrap().0;
    assert_eq!(d.planned, Some(want), "{:#?}", d.reasons);
    assert!(d.reasons.iter().any(|r| r.starts_with("with classes")), "{:#?}", d.reasons);
    // The interactive class over its own target: one worker more, and the reason names it.
    let mut late = w.clone();
    late.classes[0].ttft_s = vec![0.5; 20];
    let d = Brain::new(tight).decide(&late, want);
    assert_eq!(d.desired, want + 1, "{:#?}", d.reasons);
    assert!(d.reasons.iter().any(|r| r.contains("interactive p99 TTFT")), "{:#?}", d.reasons);
}

/// With classes, the pools of a disaggregated layout plan for each class too: the
/// prefill pool to `plan_class_pools`' prefill workers (each class's TTFT by urgency),
/// the decode pool to its decode workers at the tightest class ITL; a class over its own
/// TTFT adds a prefill worker, never a decode one.
#[test]
fn classes_plan_the_prefill_and_decode_pools_each_to_its_part() {
    let mut interactive = class_window("interactive", 0.3, 2.0, 440, 0.9, 0.05);
    interactive.itl_target_s = Some(0.03);
    let batch = class_window("batch", 30.0, 8.0, 4096, 0.0, 2.0);
    let mut w = window(10.0, 0.5);
    w.classes = vec![interactive, batch];
    let mut c = cfg();
    c.targets = Targets::at_quantile(0.3, 0.05, 0.99);
    c.workers_max = 64;
    let loads: Vec<ClassLoad> = {
        let mut b = Brain::for_pool(c.clone(), Pool::Prefill);
        b.class_loads(&w)
    };
    assert_eq!(loads.len(), 2);
    let want = plan_class_pools(&c.profile, &loads, c.targets.itl_s);
    let dp = Brain::for_pool(c.clone(), Pool::Prefill).decide(&w, 1);
    let dd = Brain::for_pool(c.clone(), Pool::Decode).decide(&w, 1);
    assert_eq!(dp.planned, want.prefill.as_ref().map(|p| p.0), "{:#?}", dp.reasons);
    assert_eq!(dd.planned, want.decode, "{:#?}", dd.reasons);
    assert!(
        dp.reasons.iter().any(|r| r.starts_with("prefill workers by urgency")),
        "{:#?}",
        dp.reasons
    );
    assert!(dd.reasons.iter().any(|r| r.contains("ITL 30.0 ms")), "{:#?}", dd.reasons);
    // The interactive prompts late: the prefill pool grows, the decode pool does not.
    let mut late = w.clone();
    late.classes[0].ttft_s = vec![0.5; 20];
    let n = want.prefill.map_or(1, |p| p.0);
    let dp = Brain::for_pool(c.clone(), Pool::Prefill).decide(&late, n);
    assert_eq!(dp.desired, n + 1, "{:#?}", dp.reasons);
    assert!(dp.reasons.iter().any(|r| r.contains("interactive p99 TTFT")), "{:#?}", dp.reasons);
    let m = want.decode.unwrap_or(1);
    let dd = Brain::for_pool(c, Pool::Decode).decide(&late, m);
    assert!(dd.desired <= m, "{:#?}", dd.reasons);
}

#[test]
fn predictors() {
    let h = [10.0, 20.0, 30.0, 40.0];
    assert_eq!(Predictor::Constant.predict(&h), 40.0);
    assert_eq!(Predictor::Ewma { alpha: 1.0 }.predict(&h), 40.0);
    assert_eq!(Predictor::Ewma { alpha: 0.5 }.predict(&[0.0, 8.0]), 4.0);
    // A straight line is extrapolated exactly.
    let t = Predictor::Trend { alpha: 0.6, beta: 0.4 }.predict(&h);
    assert!((t - 50.0).abs() < 1e-9, "{t}");
    assert_eq!(Predictor::Trend { alpha: 0.5, beta: 0.5 }.predict(&[10.0, 0.0, 0.0]), 0.0);
    assert_eq!(Predictor::Constant.predict(&[]), 0.0);
    assert_eq!(Predictor::parse("ewma:0.3"), Ok(Predictor::Ewma { alpha: 0.3 }));
    assert!(Predictor::parse("trend:2:0.1").is_err());
    assert!(Predictor::parse("prophet").is_err());
}

#[test]
fn scales_up_at_once_and_down_after_two_intervals_within_bounds() {
    let mut b = Brain::new(cfg());
    let idle = b.decide(&LoadWindow { duration: Duration::from_secs(10), ..Default::default() }, 1);
    assert_eq!((idle.action, idle.desired), (Action::Hold, 1), "{:?}", idle.reasons);
    // 40 req/s of 512+64 tokens: prefill 20 ms each, 0.8 busy in prefill; decode batches
    // of ~8 at ~9 ms: 4 workers or so.
    let busy = b.decide(&window(40.0, 0.05), 1);
    assert_eq!(busy.action, Action::Up, "{:?}", busy.reasons);
    let n = busy.desired;
    assert!((2..=8).contains(&n), "{n}: {:?}", busy.reasons);
    assert_eq!(busy.planned, Some(n));
    // The load halves: the first ask for fewer is held, the second acted on.
    let first = b.decide(&window(10.0, 0.05), n);
    assert_eq!((first.action, first.desired), (Action::Hold, n), "{:?}", first.reasons);
    let second = b.decide(&window(10.0, 0.05), n);
    assert_eq!(second.action, Action::Down, "{:?}", second.reasons);
    assert!(second.desired < n);
    // Far more than the bound allows.
    let huge = b.decide(&window(2000.0, 0.05), second.desired);
    assert_eq!(huge.desired, 8, "{:?}", huge.reasons);
    assert!(huge.reasons.iter().any(|r| r.contains("bounded")), "{:?}", huge.reasons);
}

#[test]
fn a_missed_target_adds_a_worker_the_model_did_not_ask_for() {
    let mut b = Brain::new(cfg());
    // A light load the plan serves with one worker, but TTFT p99 is 900 ms.
    let d = b.decide(&window(2.0, 0.9), 1);
    assert_eq!(d.planned, Some(1));
    assert_eq!((d.action, d.desired), (Action::Up, 2), "{:?}", d.reasons);
    assert!(d.reasons.iter().any(|r| r.contains("above the target")), "{:?}", d.reasons);
}

/// Once a load missed the target with the workers the plan asked for, the planner does
/// not drain the worker it added as soon as latencies recover at the same load.
#[test]
fn a_missed_target_is_learned_and_does_not_flap() {
    let mut b = Brain::new(cfg());
    let d = b.decide(&window(2.0, 0.9), 1);
    assert_eq!(d.desired, 2);
    for _ in 0..4 {
        let d = b.decide(&window(2.0, 0.2), 2);
        assert_eq!(d.desired, 2, "{:?}", d.reasons);
        assert_eq!(d.learned_workers, Some(2));
    }
    // A lower load is not held to it.
    let lower = b.decide(&window(1.0, 0.2), 2);
    assert_eq!(lower.learned_workers, Some(2));
    assert!(!lower.reasons.iter().any(|r| r.contains("optimistic")), "{:?}", lower.reasons);
    // Calm intervals (under half the target) make it forget.
    let mut b = Brain::new(cfg());
    b.decide(&window(2.0, 0.9), 1);
    let mut n = 2;
    let mut forgot_at = None;
    for i in 0..20 {
        let d = b.decide(&window(2.0, 0.05), n);
        n = d.desired;
        if d.learned_workers.is_none() && forgot_at.is_none() {
            forgot_at = Some(i + 1);
        }
    }
    assert_eq!(forgot_at, Some(LEARNED_CALM as usize));
    assert_eq!(n, 1, "back to what the profile says");
}

/// Latencies over the target right after the load fell are the queue the busier interval
/// left: the planner adds a worker for it but does not learn that the lower rate needs
/// that many, so it drains them when the queue is gone (the live test once flapped: a
/// light load brought back the workers it had just drained).
#[test]
fn a_backlog_after_the_load_fell_is_not_learned() {
    let mut b = Brain::new(cfg());
    let busy = b.decide(&window(40.0, 0.05), 1);
    let n = busy.desired;
    assert!(n >= 2, "{:?}", busy.reasons);
    let backlog = b.decide(&window(4.0, 0.9), n);
    assert_eq!(backlog.desired, n + 1, "{:?}", backlog.reasons);
    assert_eq!(backlog.learned_workers, None, "{:?}", backlog.reasons);
    assert!(backlog.reasons.iter().any(|r| r.contains("backlog")), "{:?}", backlog.reasons);
    // The queue is gone at the same light load: down after two asks, and it stays down.
    let mut now = n + 1;
    for _ in 0..4 {
        now = b.decide(&window(4.0, 0.1), now).desired;
    }
    assert_eq!(now, 1, "the light load kept workers a backlog brought");
    for _ in 0..3 {
        let d = b.decide(&window(4.4, 0.1), now);
        assert_eq!(d.desired, 1, "{:?}", d.reasons);
    }
}

/// Two pools of one disaggregated layout: each takes its own number from the plan's
/// disaggregated layout, and only the latency it governs corrects it.
#[test]
fn prefill_and_decode_pools_plan_and_correct_on_their_own() {
    let (mut p, mut d) =
        (Brain::for_pool(cfg(), Pool::Prefill), Brain::for_pool(cfg(), Pool::Decode));
    let w = window(40.0, 0.05);
    let plan = crate::sla::plan(
        &cfg().profile,
        &Workload {
            rate: 40.0,
            isl: 512.0,
            osl: 64.0,
            hit_rate: 0.0,
            isl_dist: Default::default(),
        },
        &cfg().targets,
    );
    let crate::sla::Need::Disaggregated { prefill, decode, .. } = plan.disaggregated else {
        panic!("{:?}", plan.reasons)
    };
    let (dp, dd) = (p.decide(&w, 1), d.decide(&w, 1));
    assert_eq!((dp.pool, dp.planned), (Pool::Prefill, Some(prefill)), "{:?}", dp.reasons);
    assert_eq!((dd.pool, dd.planned), (Pool::Decode, Some(decode)), "{:?}", dd.reasons);
    assert!(dp.reasons[0].starts_with("prefill: "), "{:?}", dp.reasons);
    // TTFT missed at a light load: the prefill pool grows; the decode pool does not.
    let (mut p, mut d) =
        (Brain::for_pool(cfg(), Pool::Prefill), Brain::for_pool(cfg(), Pool::Decode));
    let slow_first = window(2.0, 0.9);
    let (dp, dd) = (p.decide(&slow_first, 1), d.decide(&slow_first, 1));
    assert_eq!((dp.action, dp.desired), (Action::Up, 2), "{:?}", dp.reasons);
    assert_eq!(dp.learned_workers, Some(2));
    assert_eq!((dd.action, dd.desired), (Action::Hold, 1), "{:?}", dd.reasons);
    assert!(!dd.reasons.iter().any(|r| r.contains("above the target")), "{:?}", dd.reasons);
    // ITL missed: the decode pool grows; the prefill pool does not.
    let (mut p, mut d) =
        (Brain::for_pool(cfg(), Pool::Prefill), Brain::for_pool(cfg(), Pool::Decode));
    let mut slow_steps = window(2.0, 0.05);
    slow_steps.itl_s.iter_mut().for_each(|x| *x = 0.08);
    let (dp, dd) = (p.decide(&slow_steps, 1), d.decide(&slow_steps, 1));
    assert_eq!((dd.action, dd.desired), (Action::Up, 2), "{:?}", dd.reasons);
    assert!(dd.reasons.iter().any(|r| r.contains("mean ITL")), "{:?}", dd.reasons);
    assert_eq!((dp.action, dp.desired), (Action::Hold, 1), "{:?}", dp.reasons);
}

/// Prompt lengths as the window saw them: one in eight 7× the mean, the rest short (the
/// same mean) queue behind the long ones, and the plan needs more prefill workers than
/// for prompts all of the mean length.
#[test]
fn spread_prompts_plan_more_prefill_than_prompts_of_their_mean() {
    let fixed = window(40.0, 0.05);
    let mut spread = window(40.0, 0.05);
    let short = (4096.0 - 3584.0) / 7.0;
    spread.prompt_lens =
        (0..spread.prompt_lens.len()).map(|i| if i % 8 == 0 { 3584.0 } else { short }).collect();
    let a = Brain::for_pool(cfg(), Pool::Prefill).decide(&fixed, 1);
    let b = Brain::for_pool(cfg(), Pool::Prefill).decide(&spread, 1);
    assert_eq!(a.predicted.isl, b.predicted.isl);
    assert!(b.planned > a.planned, "{:?} against {:?}: {:?}", b.planned, a.planned, b.reasons);
    assert!(b.reasons.iter().any(|r| r.contains("prompts spread over")), "{:?}", b.reasons);
    // Too few prompts to see a shape: planned as prompts of the mean length.
    let mut few = window(2.0, 0.05);
    few.prompt_lens.truncate(DIST_POINTS - 1);
    let c = Brain::for_pool(cfg(), Pool::Prefill).decide(&few, 1);
    assert_eq!(c.predicted.isl_dist, LengthDist::Fixed);
}

#[test]
fn observations_of_a_window() {
    let w = LoadWindow {
        duration: Duration::from_secs(2),
        arrivals: 4,
        requests: 4,
        counted: 4,
        errors: 1,
        prompt_tokens: 400,
        generated_tokens: 40,
        cached_tokens: 100,
        ttft_s: vec![0.1, 0.2, 0.3, 0.4],
        itl_s: vec![],
        prompt_lens: vec![100.0; 4],
        classes: Vec::new(),
    };
    let o = Observed::of(&w, Some(0.5));
    assert_eq!((o.rate, o.isl, o.osl, o.hit_rate), (2.0, Some(100.0), Some(10.0), Some(0.25)));
    assert_eq!((o.ttft_s, o.itl_s), (Some(0.2), None));
    assert!((Observed::of(&w, None).ttft_s.unwrap() - 0.25).abs() < 1e-12);
}
