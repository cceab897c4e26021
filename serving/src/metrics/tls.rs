//! The TLS part of `/metrics`: the end of validity of the process's certificate (for the
//! alert on certificates that expire within 14 days), handshakes, plaintext peers refused,
//! reloads.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;

use super::{family, plain, LabelValue, Snapshot, Source, Value};

/// What the TLS counters say now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSnapshot {
    /// The certificate's end of validity, seconds since the Unix epoch.
    pub not_after: i64,
    /// Handshakes completed.
    pub handshakes: u64,
    /// Handshakes that failed.
    pub handshake_failures: u64,
    /// Plaintext peers refused.
    pub plaintext_refused: u64,
    /// Reloads that succeeded.
    pub reloads: u64,
    /// Reloads that failed.
    pub reload_failures: u64,
}

/// The process's TLS as a metrics source.
#[derive(Debug, Clone)]
pub struct TlsSource(pub Arc<kvfabric::tls::Tls>);

impl Source for TlsSource {
    fn snapshot(&self, out: &mut Snapshot) {
        let c = kvfabric::tls::counters();
        out.tls = Some(TlsSnapshot {
            not_after: self.0.not_after(),
            handshakes: c.handshakes.load(Ordering::Relaxed),
            handshake_failures: c.handshake_failures.load(Ordering::Relaxed),
            plaintext_refused: c.plaintext_refused.load(Ordering::Relaxed),
            reloads: c.reloads.load(Ordering::Relaxed),
            reload_failures: c.reload_failures.load(Ordering::Relaxed),
        });
    }
    fn health(&self, out: &mut kvfabric::health::Health) {
        out.tls = Some(self.0.health());
    }
}

/// Encodes the TLS families.
pub(super) fn encode(
    e: &mut DescriptorEncoder<'_>,
    s: &[(Option<LabelValue>, Snapshot)],
) -> std::fmt::Result {
    use MetricType::{Counter as C, Gauge as G};
    family(
        e,
        s,
        "kvfabric_tls_cert_not_after_timestamp_seconds",
        "When the certificate this process serves with stops being valid (Unix seconds).",
        None,
        G,
        |s, o| o.extend(s.tls.as_ref().map(|t| (Vec::new(), Value::Float(t.not_after as f64)))),
    )?;
    type Counter = (&'static str, &'static str, fn(&TlsSnapshot) -> u64);
    let counters: [Counter; 5] = [
        ("kvfabric_tls_handshakes", "TLS handshakes completed (as server and client).", |t| {
            t.handshakes
        }),
        (
            "kvfabric_tls_handshake_failures",
            "TLS handshakes that failed: a certificate not trusted or expired, a peer gone.",
            |t| t.handshake_failures,
        ),
        (
            "kvfabric_tls_plaintext_refused",
            "Peers that connected without TLS to a port that requires mutual TLS.",
            |t| t.plaintext_refused,
        ),
        ("kvfabric_tls_reloads", "Certificate reloads (SIGHUP) that succeeded.", |t| t.reloads),
        (
            "kvfabric_tls_reload_failures",
            "Certificate reloads that failed (the certificates in use stay).",
            |t| t.reload_failures,
        ),
    ];
    for (name, help, get) in counters {
        family(e, s, name, help, None, C, |s, o| o.extend(s.tls.as_ref().map(|t| plain(get(t)))))?;
    }
    Ok(())
}
