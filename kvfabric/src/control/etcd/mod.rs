//! Discovery on etcd (feature `etcd`), through etcd's HTTP/JSON gateway ([`gateway`]: no
//! protoc at build time): an instance is the key
//! `/kvfabric/v1/{namespace}/{kind}/{id}` holding its JSON, attached to a lease of its TTL
//! that a keep-alive task refreshes every third of the TTL. If etcd restarts or the lease is
//! lost, the task grants a new lease and puts the key again (re-registration, no restart of
//! the instance). Watches list the prefix, then follow it from the next revision; when the
//! watch breaks, they list again, report the difference as joins and leaves, and resume.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use tokio::sync::mpsc;

use super::{
    check_name, claim, ControlError, ControlFuture, Discovery, DiscoveryEvent, Held, Instance,
    Registration,
};

mod gateway;
pub use gateway::EtcdSecurity;

use gateway::{
    b64, prefix_end, Gateway, LeaseResponse, RangeResponse, StatusResponse, TxnResponse,
    WatchResponse,
};

/// Time allowed for one etcd call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A watch that saw nothing for this long is re-established.
const WATCH_REFRESH: Duration = Duration::from_secs(10);

/// Turns on etcd's authentication with a `root` user of `password` (what `etcdctl user add
/// root` and `etcdctl auth enable` do), over the gateway: for tests and deployment scripts.
pub async fn enable_root_auth(
    endpoints: &[String],
    security: EtcdSecurity,
    password: &str,
) -> Result<(), ControlError> {
    let etcd = Gateway::new(endpoints, CALL_TIMEOUT, EtcdSecurity { user: None, ..security })?;
    let _: serde_json::Value = etcd
        .call(
            "etcd user add",
            "/v3/auth/user/add",
            &json!({ "name": "root", "password": password }),
        )
        .await?;
    let _: serde_json::Value = etcd
        .call("etcd user grant", "/v3/auth/user/grant", &json!({ "user": "root", "role": "root" }))
        .await?;
    let _: serde_json::Value = etcd.call("etcd auth enable", "/v3/auth/enable", &json!({})).await?;
    Ok(())
}

/// Discovery backed by an etcd cluster (v3 API, through etcd's HTTP/JSON gateway).
#[derive(Debug, Clone)]
pub struct EtcdDiscovery {
    etcd: Gateway,
    namespace: String,
}

impl EtcdDiscovery {
    /// Connects to `endpoints` (such as `http://127.0.0.1:2379`): checks that one answers.
    pub async fn connect(endpoints: &[String], namespace: &str) -> Result<Self, ControlError> {
        Self::connect_with(endpoints, namespace, EtcdSecurity::default()).await
    }

    /// Connects with TLS and etcd's user authentication as `security` says; a wrong CA, an
    /// expired certificate or a wrong password is an error here, within the call timeout.
    pub async fn connect_with(
        endpoints: &[String],
        namespace: &str,
        security: EtcdSecurity,
    ) -> Result<Self, ControlError> {
        check_name(namespace)?;
        let etcd = Gateway::new(endpoints, CALL_TIMEOUT, security)?;
        etcd.authenticate().await?;
        let status: StatusResponse =
            etcd.call("etcd connect", "/v3/maintenance/status", &json!({})).await?;
        tracing::debug!(version = %status.version, ?endpoints, "connected to etcd");
        let d = EtcdDiscovery { etcd, namespace: namespace.to_string() };
        // The status answers anyone; a read of the namespace tells, at start, whether this
        // client may use the keys (etcd's authentication and its roles).
        let prefix = format!("/kvfabric/v1/{}/", d.namespace);
        let check = json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix.as_bytes())),
            "limit": "1",
            "keys_only": true,
        });
        let _: RangeResponse = d.etcd.call("etcd access check", "/v3/kv/range", &check).await?;
        Ok(d)
    }

    fn prefix(&self, kind: &str) -> String {
        format!("/kvfabric/v1/{}/{}/", self.namespace, kind)
    }

    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}{}", self.prefix(kind), id)
    }

    /// Puts `key` under a new lease of `ttl` if no key is there (an etcd transaction on its
    /// create revision): the lease, or the lease that holds the key and the time it has left.
    async fn create_with_lease(
        etcd: &Gateway,
        key: &str,
        value: &[u8],
        ttl: Duration,
    ) -> Result<Result<i64, Held>, ControlError> {
        // etcd leases are whole seconds: round up, never shorten the TTL asked for.
        let ttl_s = ttl.as_millis().div_ceil(1000).max(1) as i64;
        let lease: LeaseResponse =
            etcd.call("etcd lease grant", "/v3/lease/grant", &json!({ "TTL": ttl_s })).await?;
        if !lease.error.is_empty() || lease.id == 0 {
            return Err(ControlError::Backend {
                backend: "etcd",
                message: format!("lease grant refused: {}", lease.error),
            });
        }
        let k = b64(key.as_bytes());
        let txn = json!({
            "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
            "success": [{ "request_put": { "key": k, "value": b64(value), "lease": lease.id.to_string() } }],
            "failure": [{ "request_range": { "key": k } }],
        });
        let resp: TxnResponse = etcd.call("etcd txn", "/v3/kv/txn", &txn).await?;
        if resp.succeeded {
            return Ok(Ok(lease.id));
        }
        let revoke = json!({ "ID": lease.id.to_string() });
        let _ = etcd.call::<serde_json::Value>("etcd revoke", "/v3/lease/revoke", &revoke).await;
        let holder = resp
            .responses
            .into_iter()
            .find_map(|r| r.response_range)
            .and_then(|r| r.kvs.into_iter().next())
            .map_or(0, |kv| kv.lease);
        // The holder's lease: how long it has left (a key without a lease never expires).
        let left = if holder == 0 {
            Duration::ZERO
        } else {
            let ttl: LeaseResponse = etcd
                .call(
                    "etcd lease ttl",
                    "/v3/lease/timetolive",
                    &json!({ "ID": holder.to_string() }),
                )
                .await?;
            Duration::from_secs(ttl.ttl.max(0) as u64)
        };
        Ok(Err(Held { lease: holder, left }))
    }

    /// Refreshes `lease` once: the seconds it has left, 0 when it no longer exists.
    async fn keep_alive(etcd: &Gateway, lease: i64) -> Result<i64, ControlError> {
        let mut stream = etcd
            .stream("etcd keep-alive", "/v3/lease/keepalive", &json!({ "ID": lease.to_string() }))
            .await?;
        let reply = tokio::time::timeout(CALL_TIMEOUT, stream.next::<LeaseResponse>())
            .await
            .map_err(|_| ControlError::Timeout("etcd keep-alive"))??;
        Ok(reply.map_or(0, |r| r.ttl))
    }

    async fn snapshot(
        &self,
        kind: &str,
    ) -> Result<(BTreeMap<String, Instance>, i64), ControlError> {
        let prefix = self.prefix(kind);
        let req = json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix.as_bytes())) });
        let resp: RangeResponse = self.etcd.call("etcd get", "/v3/kv/range", &req).await?;
        let mut out = BTreeMap::new();
        for kv in resp.kvs {
            let inst: Instance = serde_json::from_slice(&kv.value).map_err(|e| {
                ControlError::Malformed { what: "instance", message: e.to_string() }
            })?;
            out.insert(inst.id.clone(), inst);
        }
        Ok((out, resp.header.revision))
    }
}

impl Discovery for EtcdDiscovery {
    fn status(&self) -> crate::health::ControlHealth {
        self.etcd.health().status()
    }

    fn register(&self, instance: Instance, ttl: Duration) -> ControlFuture<'_, Registration> {
        Box::pin(async move {
            check_name(&instance.kind)?;
            check_name(&instance.id)?;
            let key = self.key(&instance.kind, &instance.id);
            let value = serde_json::to_vec(&instance).map_err(|e| ControlError::Malformed {
                what: "instance",
                message: e.to_string(),
            })?;
            let etcd = self.etcd.clone();
            let mut lease = claim(&instance.kind, &instance.id, || {
                Self::create_with_lease(&etcd, &key, &value, ttl)
            })
            .await?;
            tracing::debug!(%key, lease, ttl_ms = ttl.as_millis() as u64, "registered in etcd");
            let (kind, id) = (instance.kind.clone(), instance.id.clone());
            let (revoke_tx, mut revoke_rx) =
                tokio::sync::oneshot::channel::<tokio::sync::oneshot::Sender<()>>();
            let keepalive = tokio::spawn(async move {
                let period = (ttl / 3).max(Duration::from_millis(200));
                // Set while etcd cannot be reached or the registration is being restored:
                // the loss and the recovery are logged once each.
                let mut lost: Option<ControlError> = None;
                loop {
                    tokio::select! {
                        done = &mut revoke_rx => {
                            let _ = etcd
                                .call::<serde_json::Value>(
                                    "etcd revoke",
                                    "/v3/lease/revoke",
                                    &json!({ "ID": lease.to_string() }),
                                )
                                .await;
                            if let Ok(done) = done {
                                let _ = done.send(());
                            }
                            return;
                        }
                        _ = tokio::time::sleep(period) => {}
                    }
                    let outcome = match Self::keep_alive(&etcd, lease).await {
                        Ok(left) if left > 0 => Ok(()),
                        // The lease is gone (expired, or etcd lost it): register again,
                        // unless another instance took the name meanwhile.
                        Ok(_) => match Self::create_with_lease(&etcd, &key, &value, ttl).await {
                            Ok(Ok(l)) => {
                                tracing::info!(%key, lease = l, "lease was lost; registered in etcd again");
                                lease = l;
                                Ok(())
                            }
                            Ok(Err(_)) => {
                                Err(ControlError::Taken { kind: kind.clone(), id: id.clone() })
                            }
                            Err(e) => Err(e),
                        },
                        // A transient error (etcd restarting, a dropped connection) leaves
                        // the lease alive: keep it, so watchers see no spurious leave and join.
                        Err(e) => Err(e),
                    };
                    // etcd's loss and return are logged once per process by its health;
                    // here only what concerns this registration.
                    match (outcome, lost.is_some()) {
                        (Ok(()), true) => {
                            tracing::debug!(%key, "registration kept through the outage");
                            lost = None;
                        }
                        (Err(e), was_lost) => {
                            etcd.health().lease_renewal_failed();
                            if !was_lost {
                                if matches!(e, ControlError::Taken { .. }) {
                                    // Not an outage: another instance holds the name now.
                                    tracing::warn!(%key, error = %e, "registration lost; retrying every {period:?}");
                                } else {
                                    tracing::debug!(%key, error = %e, "etcd keep-alive failed; retrying every {period:?}");
                                }
                                lost = Some(e);
                            }
                        }
                        _ => {}
                    }
                }
            });
            Ok(Registration { revoke: Some(revoke_tx), keepalive })
        })
    }

    fn list<'a>(&'a self, kind: &'a str) -> ControlFuture<'a, Vec<Instance>> {
        Box::pin(async move {
            check_name(kind)?;
            Ok(self.snapshot(kind).await?.0.into_values().collect())
        })
    }

    fn watch<'a>(
        &'a self,
        kind: &'a str,
    ) -> ControlFuture<'a, (Vec<Instance>, mpsc::Receiver<DiscoveryEvent>)> {
        Box::pin(async move {
            check_name(kind)?;
            let (mut known, mut revision) = self.snapshot(kind).await?;
            let initial: Vec<Instance> = known.values().cloned().collect();
            let (tx, rx) = mpsc::channel(super::memory::SUBSCRIBER_BUFFER);
            let this = self.clone();
            let kind = kind.to_string();
            tokio::spawn(async move {
                let prefix = this.prefix(&kind);
                let range_end = b64(&prefix_end(prefix.as_bytes()));
                let mut broken = false;
                loop {
                    let create = json!({ "create_request": {
                        "key": b64(prefix.as_bytes()),
                        "range_end": range_end,
                        "start_revision": (revision + 1).to_string(),
                    }});
                    match this.etcd.stream("etcd watch", "/v3/watch", &create).await {
                        Ok(mut stream) => {
                            if broken {
                                tracing::debug!(%prefix, "etcd watch re-established");
                                broken = false;
                            }
                            // A quiet watch is re-established (list, diff, resume) every
                            // WATCH_REFRESH, so a half-open connection cannot hide leaves for
                            // long.
                            while let Ok(Ok(Some(resp))) =
                                tokio::time::timeout(WATCH_REFRESH, stream.next::<WatchResponse>())
                                    .await
                            {
                                if resp.canceled || resp.compact_revision > 0 {
                                    break;
                                }
                                for ev in resp.events {
                                    let kv = ev.kv;
                                    revision = revision.max(kv.mod_revision);
                                    let key = String::from_utf8_lossy(&kv.key);
                                    let id = key.trim_start_matches(&prefix).to_string();
                                    let out = if ev.kind == "DELETE" {
                                        known.remove(&id);
                                        DiscoveryEvent::Left { kind: kind.clone(), id }
                                    } else {
                                        match serde_json::from_slice::<Instance>(&kv.value) {
                                            Ok(inst) => {
                                                known.insert(id, inst.clone());
                                                DiscoveryEvent::Joined(inst)
                                            }
                                            Err(e) => {
                                                tracing::warn!(%key, error = %e, "ignoring a malformed instance in etcd");
                                                continue;
                                            }
                                        }
                                    };
                                    if tx.send(out).await.is_err() {
                                        return;
                                    }
                                }
                            }
                        }
                        Err(e) => {
                            if !broken {
                                tracing::debug!(%prefix, error = %e, "etcd watch failed; retrying");
                                broken = true;
                            }
                        }
                    }
                    if tx.is_closed() {
                        return;
                    }
                    // The watch broke (etcd restarted, or compacted past us): list again and
                    // report the difference.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let Ok((now, rev)) = this.snapshot(&kind).await else { continue };
                    for (id, _) in known.iter().filter(|(id, _)| !now.contains_key(*id)) {
                        let _ = tx
                            .send(DiscoveryEvent::Left { kind: kind.clone(), id: id.clone() })
                            .await;
                    }
                    for (id, inst) in now.iter() {
                        if known.get(id) != Some(inst) {
                            let _ = tx.send(DiscoveryEvent::Joined(inst.clone())).await;
                        }
                    }
                    known = now;
                    revision = rev;
                }
            });
            Ok((initial, rx))
        })
    }
}
