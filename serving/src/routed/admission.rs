//! What the routed backend does around a worker's membership (the router crate's
//! [`Membership`] keeps who is a member): loads a joining worker's tokenizer, checks in the
//! background that it accepts this frontend's secret, forgets its kept connections when it
//! leaves; and how a failed attempt weighs on the worker (avoided, refused, forgiven).

use super::*;

/// The routed backend's part in membership.
pub(super) struct Admit(pub(super) std::sync::Weak<Inner>);

impl kvfabric_router::membership::Admission for Admit {
    async fn admit(&self, _name: &str, md: &WorkerMetadata) -> Result<(), String> {
        let inner = self.0.upgrade().ok_or("the frontend stopped")?;
        if inner.codecs.lock().contains_key(&md.codec) {
            return Ok(());
        }
        let spec = md.codec.clone();
        match tokio::task::spawn_blocking(move || TextCodec::from_spec(&spec)).await {
            Ok(Ok(c)) => {
                inner.codecs.lock().insert(md.codec.clone(), Arc::new(c));
                Ok(())
            }
            Ok(Err(e)) => Err(format!("its tokenizer cannot be loaded: {e}")),
            Err(e) => Err(format!("loading its tokenizer failed: {e}")),
        }
    }

    fn joined(&self, name: &str, addr: SocketAddr) {
        if let Some(inner) = self.0.upgrade() {
            inner.probe(name.to_string(), addr);
        }
    }

    fn left(&self, name: &str, addr: SocketAddr) {
        if let Some(inner) = self.0.upgrade() {
            inner.pool.forget(addr, name);
        }
    }
}

impl Inner {
    /// A worker did not answer (no connection, no handshake or no first token in time):
    /// avoid it for a while.
    pub(super) fn penalise(&self, name: &str) {
        self.stats.slow_workers.fetch_add(1, Ordering::Relaxed);
        self.members.penalise(name);
    }

    /// Checks in the background that a worker that joined accepts this frontend's secret.
    pub(super) fn probe(self: &Arc<Self>, name: String, addr: SocketAddr) {
        let this = Arc::downgrade(self);
        let auth = Auth {
            name: self.cfg.name.clone(),
            secret: self.cfg.secret.clone(),
            tls: self.cfg.tls.clone(),
        };
        let timeout = self.cfg.connect_timeout;
        tokio::spawn(async move {
            if let Err(e) = protocol::probe(addr, &name, &auth, timeout).await {
                if let Some(this) = this.upgrade().filter(|_| e.is_auth()) {
                    this.refuse(&name, &e);
                }
            }
        });
    }

    /// A worker's handshake failed on the secret, or it answered in another protocol version:
    /// out of routing, counted (a secret), logged once per worker until it serves again.
    pub(super) fn refuse(&self, name: &str, e: &protocol::FrameError) {
        if e.is_version() {
            self.members.refuse(name, e.to_string(), Refusal::Version);
        } else {
            self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            let why = format!("refused this frontend's secret ({e})");
            self.members.refuse(name, why, Refusal::Secret);
        }
    }
}
