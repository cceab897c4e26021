//! Discovery on etcd (feature `etcd`): an instance is the key
//! `/kvfabric/v1/{namespace}/{kind}/{id}` holding its JSON, attached to a lease of its TTL
//! that a keep-alive task refreshes every third of the TTL. If etcd restarts or the lease is
//! lost, the task grants a new lease and puts the key again (re-registration, no restart of
//! the instance). Watches list the prefix, then follow it from the next revision; when the
//! watch breaks, they list again, report the difference as joins and leaves, and resume.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::mpsc;

use super::{
    check_name, ControlError, ControlFuture, Discovery, DiscoveryEvent, Instance, Registration,
};

fn backend(e: etcd_client::Error) -> ControlError {
    ControlError::Backend { backend: "etcd", message: e.to_string() }
}

/// Time allowed for one etcd call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A watch that saw nothing for this long is re-established.
const WATCH_REFRESH: Duration = Duration::from_secs(30);

async fn timed<T>(
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ControlError> {
    tokio::time::timeout(CALL_TIMEOUT, f)
        .await
        .map_err(|_| ControlError::Timeout(what))?
        .map_err(backend)
}

/// Discovery backed by an etcd cluster.
#[derive(Clone)]
pub struct EtcdDiscovery {
    client: Client,
    namespace: String,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery").field("namespace", &self.namespace).finish()
    }
}

impl EtcdDiscovery {
    /// Connects to `endpoints` (such as `http://127.0.0.1:2379`).
    pub async fn connect(endpoints: &[String], namespace: &str) -> Result<Self, ControlError> {
        check_name(namespace)?;
        let client = timed("etcd connect", Client::connect(endpoints, None)).await?;
        Ok(EtcdDiscovery { client, namespace: namespace.to_string() })
    }

    fn prefix(&self, kind: &str) -> String {
        format!("/kvfabric/v1/{}/{}/", self.namespace, kind)
    }

    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}{}", self.prefix(kind), id)
    }

    async fn put_with_lease(
        client: &mut Client,
        key: &str,
        value: &[u8],
        ttl: Duration,
    ) -> Result<i64, ControlError> {
        // etcd leases are whole seconds: round up, never shorten the TTL asked for.
        let ttl_s = ttl.as_millis().div_ceil(1000).max(1) as i64;
        let lease = timed("etcd lease grant", client.lease_grant(ttl_s, None)).await?.id();
        timed("etcd put", client.put(key, value, Some(PutOptions::new().with_lease(lease))))
            .await?;
        Ok(lease)
    }

    /// Whether `lease` still exists (one keep-alive round trip with a positive TTL).
    async fn lease_alive(client: &mut Client, lease: i64) -> bool {
        let Ok((mut keeper, mut responses)) =
            timed("etcd keep-alive", client.lease_keep_alive(lease)).await
        else {
            return false;
        };
        if !matches!(tokio::time::timeout(CALL_TIMEOUT, keeper.keep_alive()).await, Ok(Ok(()))) {
            return false;
        }
        matches!(tokio::time::timeout(CALL_TIMEOUT, responses.message()).await, Ok(Ok(Some(r))) if r.ttl() > 0)
    }

    async fn snapshot(
        &self,
        kind: &str,
    ) -> Result<(BTreeMap<String, Instance>, i64), ControlError> {
        let mut client = self.client.clone();
        let resp =
            timed("etcd get", client.get(self.prefix(kind), Some(GetOptions::new().with_prefix())))
                .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut out = BTreeMap::new();
        for kv in resp.kvs() {
            let inst: Instance = serde_json::from_slice(kv.value()).map_err(|e| {
                ControlError::Malformed { what: "instance", message: e.to_string() }
            })?;
            out.insert(inst.id.clone(), inst);
        }
        Ok((out, revision))
    }
}

impl Discovery for EtcdDiscovery {
    fn register(&self, instance: Instance, ttl: Duration) -> ControlFuture<'_, Registration> {
        Box::pin(async move {
            check_name(&instance.kind)?;
            check_name(&instance.id)?;
            let key = self.key(&instance.kind, &instance.id);
            let value = serde_json::to_vec(&instance).map_err(|e| ControlError::Malformed {
                what: "instance",
                message: e.to_string(),
            })?;
            let mut client = self.client.clone();
            let mut lease = Self::put_with_lease(&mut client, &key, &value, ttl).await?;
            let (revoke_tx, mut revoke_rx) =
                tokio::sync::oneshot::channel::<tokio::sync::oneshot::Sender<()>>();
            let keepalive = tokio::spawn(async move {
                let period = (ttl / 3).max(Duration::from_millis(200));
                loop {
                    // One keep-alive stream per lease; on any failure, re-register.
                    let stream = timed("etcd keep-alive", client.lease_keep_alive(lease)).await;
                    if let Ok((mut keeper, mut responses)) = stream {
                        loop {
                            tokio::select! {
                                done = &mut revoke_rx => {
                                    let _ = timed("etcd revoke", client.lease_revoke(lease)).await;
                                    if let Ok(done) = done {
                                        let _ = done.send(());
                                    }
                                    return;
                                }
                                _ = tokio::time::sleep(period) => {
                                    match tokio::time::timeout(CALL_TIMEOUT, keeper.keep_alive()).await {
                                        Ok(Ok(())) => {}
                                        _ => break,
                                    }
                                    match tokio::time::timeout(CALL_TIMEOUT, responses.message()).await {
                                        // ttl 0: the lease is gone (expired, or etcd lost it).
                                        Ok(Ok(Some(r))) if r.ttl() > 0 => {}
                                        _ => break,
                                    }
                                }
                            }
                        }
                    }
                    // Lost: retry until etcd takes the registration again.
                    loop {
                        tokio::select! {
                            done = &mut revoke_rx => {
                                if let Ok(done) = done {
                                    let _ = done.send(());
                                }
                                return;
                            }
                            _ = tokio::time::sleep(period) => {
                                // A transient error (a dropped stream) leaves the lease alive:
                                // keep it, so watchers see no spurious leave and join.
                                if Self::lease_alive(&mut client, lease).await {
                                    break;
                                }
                                // The lease is gone (expired, or etcd lost it): register again.
                                if let Ok(l) = Self::put_with_lease(&mut client, &key, &value, ttl).await {
                                    lease = l;
                                    break;
                                }
                            }
                        }
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
                loop {
                    let mut client = this.client.clone();
                    let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
                    if let Ok(mut stream) =
                        timed("etcd watch", client.watch(prefix.clone(), Some(opts))).await
                    {
                        // A quiet watch is re-established (list, diff, resume) every
                        // WATCH_REFRESH, so a half-open connection cannot hide leaves for long.
                        while let Ok(Ok(Some(resp))) =
                            tokio::time::timeout(WATCH_REFRESH, stream.message()).await
                        {
                            if resp.canceled() {
                                break;
                            }
                            for ev in resp.events() {
                                let Some(kv) = ev.kv() else { continue };
                                revision = revision.max(kv.mod_revision());
                                let id = kv
                                    .key_str()
                                    .unwrap_or("")
                                    .trim_start_matches(&prefix)
                                    .to_string();
                                let out = match ev.event_type() {
                                    EventType::Put => {
                                        match serde_json::from_slice::<Instance>(kv.value()) {
                                            Ok(inst) => {
                                                known.insert(id, inst.clone());
                                                DiscoveryEvent::Joined(inst)
                                            }
                                            Err(_) => continue,
                                        }
                                    }
                                    EventType::Delete => {
                                        known.remove(&id);
                                        DiscoveryEvent::Left { kind: kind.clone(), id }
                                    }
                                };
                                if tx.send(out).await.is_err() {
                                    return;
                                }
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
