//! Each service class's metrics, kept by the frontend: requests by outcome, TTFT and ITL
//! histograms, how many met their class's targets, how many were shed or expired, and how
//! many wait for their first token now.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::{ITL_BUCKETS, LATENCY_BUCKETS};

type Labels = Vec<(&'static str, String)>;
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// A class's targets, as the metrics judge its requests.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    ttft: Option<Duration>,
    itl: Option<Duration>,
}

/// How a request of a class ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassOutcome {
    /// Answered.
    Ok,
    /// Shed (429) for a more urgent class, or the queues were full.
    Shed,
    /// Its deadline passed before it was served (504).
    Expired,
    /// Another failure on the server's side.
    Failed,
    /// The client went away.
    Cancelled,
}

impl ClassOutcome {
    fn label(self) -> &'static str {
        match self {
            ClassOutcome::Ok => "ok",
            ClassOutcome::Shed => "shed",
            ClassOutcome::Expired => "expired",
            ClassOutcome::Failed => "failed",
            ClassOutcome::Cancelled => "cancelled",
        }
    }
}

/// One class's totals since start ([`ClassMetrics::totals`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ClassTotals {
    /// The class.
    pub class: String,
    /// Its TTFT target, seconds.
    pub ttft_target_s: Option<f64>,
    /// Its ITL target, seconds.
    pub itl_target_s: Option<f64>,
    /// Requests that met its targets.
    pub met: u64,
    /// Requests that did not (late, shed, expired, failed).
    pub missed: u64,
    /// Of them, shed.
    pub shed: u64,
    /// Of them, expired.
    pub expired: u64,
    /// Waiting for their first token now.
    pub waiting: i64,
}

/// The per-class metrics. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct ClassMetrics {
    targets: Arc<parking_lot::RwLock<Vec<Target>>>,
    requests: Family<Labels, Counter>,
    ttft: Histograms,
    itl: Histograms,
    slo: Family<Labels, Counter>,
    waiting: Family<Labels, Gauge>,
}

fn ttft_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS.iter().copied())
}

fn itl_histogram() -> Histogram {
    Histogram::new(ITL_BUCKETS.iter().copied())
}

impl Default for ClassMetrics {
    fn default() -> Self {
        ClassMetrics {
            targets: Default::default(),
            requests: Family::default(),
            ttft: Family::new_with_constructor(ttft_histogram),
            itl: Family::new_with_constructor(itl_histogram),
            slo: Family::default(),
            waiting: Family::default(),
        }
    }
}

fn class(name: &str) -> Labels {
    vec![("class", name.to_string())]
}

impl ClassMetrics {
    /// The classes, in their index order: every series exists from the start, at 0.
    pub fn set(
        &self,
        classes: impl IntoIterator<Item = (String, Option<Duration>, Option<Duration>)>,
    ) {
        let mut t = self.targets.write();
        *t = classes.into_iter().map(|(name, ttft, itl)| Target { name, ttft, itl }).collect();
        for c in t.iter() {
            for o in [
                ClassOutcome::Ok,
                ClassOutcome::Shed,
                ClassOutcome::Expired,
                ClassOutcome::Failed,
                ClassOutcome::Cancelled,
            ] {
                drop(self.requests.get_or_create(&vec![
                    ("class", c.name.clone()),
                    ("outcome", o.label().into()),
                ]));
            }
            for r in ["met", "missed"] {
                drop(
                    self.slo.get_or_create(&vec![("class", c.name.clone()), ("result", r.into())]),
                );
            }
            drop(self.waiting.get_or_create(&class(&c.name)));
            drop(self.ttft.get_or_create(&class(&c.name)));
            drop(self.itl.get_or_create(&class(&c.name)));
        }
    }

    fn name(&self, i: usize) -> Option<String> {
        self.targets.read().get(i).map(|t| t.name.clone())
    }

    /// A request of class `i` was submitted.
    pub fn submitted(&self, i: usize) {
        if let Some(n) = self.name(i) {
            self.waiting.get_or_create(&class(&n)).inc();
        }
    }

    /// Its first token, `d` after it arrived.
    pub fn first_token(&self, i: usize, d: Duration) {
        if let Some(n) = self.name(i) {
            self.waiting.get_or_create(&class(&n)).dec();
            self.ttft.get_or_create(&class(&n)).observe(d.as_secs_f64());
        }
    }

    /// The classes' names and targets (seconds), in index order.
    pub fn targets(&self) -> Vec<(String, Option<f64>, Option<f64>)> {
        let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
        self.targets.read().iter().map(|t| (t.name.clone(), secs(t.ttft), secs(t.itl))).collect()
    }

    /// A gap between two of its tokens.
    pub fn inter_token(&self, i: usize, d: Duration) {
        if let Some(n) = self.name(i) {
            self.itl.get_or_create(&class(&n)).observe(d.as_secs_f64());
        }
    }

    /// A request of class `i` ended: how, its TTFT (if a token came) and its mean time per
    /// output token after the first (if it had two). It met the class's targets if it was
    /// answered with both within them.
    pub fn finished(
        &self,
        i: usize,
        outcome: ClassOutcome,
        ttft: Option<Duration>,
        tpot: Option<Duration>,
    ) {
        let Some(t) = self.targets.read().get(i).cloned() else { return };
        if ttft.is_none() {
            self.waiting.get_or_create(&class(&t.name)).dec();
        }
        self.requests
            .get_or_create(&vec![("class", t.name.clone()), ("outcome", outcome.label().into())])
            .inc();
        let met = outcome == ClassOutcome::Ok
            && ttft.zip(t.ttft).is_none_or(|(got, want)| got <= want)
            && tpot.zip(t.itl).is_none_or(|(got, want)| got <= want);
        let result = if met { "met" } else { "missed" };
        self.slo.get_or_create(&vec![("class", t.name), ("result", result.into())]).inc();
    }

    /// Every class's totals since start.
    pub fn totals(&self) -> Vec<ClassTotals> {
        let targets = self.targets.read().clone();
        targets
            .into_iter()
            .map(|t| {
                let get = |o: ClassOutcome| {
                    self.requests
                        .get_or_create(&vec![
                            ("class", t.name.clone()),
                            ("outcome", o.label().into()),
                        ])
                        .get()
                };
                let slo = |r: &str| {
                    self.slo
                        .get_or_create(&vec![("class", t.name.clone()), ("result", r.into())])
                        .get()
                };
                ClassTotals {
                    ttft_target_s: t.ttft.map(|d| d.as_secs_f64()),
                    itl_target_s: t.itl.map(|d| d.as_secs_f64()),
                    met: slo("met"),
                    missed: slo("missed"),
                    shed: get(ClassOutcome::Shed),
                    expired: get(ClassOutcome::Expired),
                    waiting: self.waiting.get_or_create(&class(&t.name)).get(),
                    class: t.name,
                }
            })
            .collect()
    }

    /// Registers the metrics.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvfabric_class_requests",
            "Requests per service class, by outcome (ok, shed, expired, failed, cancelled).",
            self.requests.clone(),
        );
        r.register_with_unit(
            "kvfabric_class_time_to_first_token",
            "Time to first token per service class.",
            Unit::Seconds,
            self.ttft.clone(),
        );
        r.register_with_unit(
            "kvfabric_class_inter_token_latency",
            "Time between tokens per service class.",
            Unit::Seconds,
            self.itl.clone(),
        );
        r.register(
            "kvfabric_class_slo",
            "Requests per service class that met its TTFT and ITL targets (result=met) or not (result=missed: late, shed, expired or failed).",
            self.slo.clone(),
        );
        r.register(
            "kvfabric_class_waiting",
            "Requests per service class waiting for their first token.",
            self.waiting.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_meets_its_class_only_within_both_targets() {
        let m = ClassMetrics::default();
        let ms = Duration::from_millis;
        m.set([
            ("fast".to_string(), Some(ms(300)), Some(ms(50))),
            ("slow".to_string(), None, None),
        ]);
        for _ in 0..5 {
            m.submitted(0);
        }
        m.first_token(0, ms(100));
        m.finished(0, ClassOutcome::Ok, Some(ms(100)), Some(ms(20)));
        m.first_token(0, ms(400));
        m.finished(0, ClassOutcome::Ok, Some(ms(400)), Some(ms(20)));
        m.first_token(0, ms(100));
        m.finished(0, ClassOutcome::Ok, Some(ms(100)), Some(ms(60)));
        m.finished(0, ClassOutcome::Shed, None, None);
        m.submitted(1);
        m.finished(1, ClassOutcome::Expired, None, None);
        let t = m.totals();
        assert_eq!((t[0].met, t[0].missed, t[0].shed, t[0].waiting), (1, 3, 1, 1));
        assert_eq!((t[1].met, t[1].missed, t[1].expired, t[1].waiting), (0, 1, 1, 0));
        let mut r = Registry::default();
        m.register(&mut r);
        let text = crate::metrics::encode(&r);
        assert!(
            text.contains(r#"kvfabric_class_slo_total{class="fast",result="met"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"kvfabric_class_requests_total{class="fast",outcome="shed"} 1"#));
        assert!(text.contains(r#"kvfabric_class_waiting{class="fast"} 1"#));
        assert!(
            text.contains(r#"kvfabric_class_time_to_first_token_seconds_count{class="fast"} 3"#)
        );
    }
}
