//! The control plane against real servers: etcd for discovery and NATS (JetStream) for the
//! event bus, started by the testkit on free loopback ports — and the embedded
//! implementation through the same scenarios.
//!
//! A registration dropped without revoking stands for a process killed -9: its keep-alive
//! stops and only the lease TTL removes it (a separate process adds nothing the backend could
//! tell apart).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfabric::control::etcd::EtcdDiscovery;
use kvfabric::control::memory::{MemoryBus, MemoryDiscovery};
use kvfabric::control::nats::NatsBus;
use kvfabric::control::{Discovery, DiscoveryEvent, EventBus, Instance};
use kvfabric::testkit::{EtcdServer, NatsServer};

fn inst(id: &str) -> Instance {
    Instance {
        kind: "fabric".into(),
        id: id.into(),
        metadata: serde_json::json!({ "tcp": format!("127.0.0.1:{}", id.len()) }),
    }
}

async fn next_event(
    rx: &mut tokio::sync::mpsc::Receiver<DiscoveryEvent>,
    within: Duration,
) -> DiscoveryEvent {
    tokio::time::timeout(within, rx.recv()).await.expect("an event in time").expect("watch open")
}

async fn discovery_scenario(d: Arc<dyn Discovery>, ttl: Duration) {
    let (initial, mut watch) = d.watch("fabric").await.unwrap();
    assert!(initial.is_empty());
    let a = d.register(inst("node-a"), ttl).await.unwrap();
    let b = d.register(inst("node-b"), ttl).await.unwrap();
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await,
        DiscoveryEvent::Joined(inst("node-a"))
    );
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await,
        DiscoveryEvent::Joined(inst("node-b"))
    );
    let ids: Vec<String> = d.list("fabric").await.unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(ids, vec!["node-a", "node-b"]);
    // Keep-alive holds the lease well past its TTL.
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(d.list("fabric").await.unwrap().len(), 2);
    // b "dies": no revoke, its keep-alive stops; it leaves within the TTL (plus slack).
    let died = Instant::now();
    drop(b);
    let ev = next_event(&mut watch, ttl + Duration::from_secs(4)).await;
    assert_eq!(ev, DiscoveryEvent::Left { kind: "fabric".into(), id: "node-b".into() });
    assert!(died.elapsed() < ttl + Duration::from_secs(4));
    // a shuts down gracefully: gone at once.
    let revoked = Instant::now();
    a.revoke().await;
    let ev = next_event(&mut watch, Duration::from_secs(3)).await;
    assert_eq!(ev, DiscoveryEvent::Left { kind: "fabric".into(), id: "node-a".into() });
    assert!(revoked.elapsed() < Duration::from_secs(3));
    assert!(d.list("fabric").await.unwrap().is_empty());
    assert!(d.register(inst("bad/id"), ttl).await.is_err(), "names are checked");
}

/// A second instance under a name in use never takes the first's registration: it is refused
/// while the first lives (which keeps its entry, and keeps it after the second gives up), and
/// takes over once a dead first's lease has expired.
async fn unique_names_scenario(d: Arc<dyn Discovery>, ttl: Duration) {
    let mut first = inst("w2");
    first.metadata = serde_json::json!({ "who": "first" });
    let held = d.register(first.clone(), ttl).await.unwrap();
    let mut second = inst("w2");
    second.metadata = serde_json::json!({ "who": "second" });
    let started = Instant::now();
    let err = d.register(second.clone(), ttl).await.unwrap_err();
    assert!(matches!(err, kvfabric::control::ControlError::Taken { .. }), "{err}");
    assert!(
        started.elapsed() >= ttl / 2,
        "it waited for the holder's lease: {:?}",
        started.elapsed()
    );
    // The first keeps its entry, past the second's attempt and its own TTL.
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(d.list("fabric").await.unwrap(), vec![first.clone()]);
    // The first dies without revoking: the second waits for its lease and takes over.
    drop(held);
    let taken = d.register(second.clone(), ttl).await.unwrap();
    assert_eq!(d.list("fabric").await.unwrap(), vec![second.clone()]);
    taken.revoke().await;
    assert!(d.list("fabric").await.unwrap().is_empty());
}

async fn bus_scenario(bus: Arc<dyn EventBus>) {
    let mut s1 = bus.subscribe("kv-events").await.unwrap();
    let mut s2 = bus.subscribe("kv-events").await.unwrap();
    for i in 0..10u8 {
        bus.publish("kv-events", vec![i]).await.unwrap();
    }
    for s in [&mut s1, &mut s2] {
        for i in 0..10u8 {
            let got =
                tokio::time::timeout(Duration::from_secs(5), s.recv()).await.unwrap().unwrap();
            assert_eq!(got, vec![i], "in order, to every subscriber");
        }
    }
    // The work queue: each item to one consumer, again until acknowledged.
    bus.enqueue("prefill", b"job-1".to_vec()).await.unwrap();
    bus.enqueue("prefill", b"job-2".to_vec()).await.unwrap();
    let wait = Duration::from_secs(2);
    let ack_wait = Duration::from_secs(1);
    let first = bus.dequeue("prefill", wait, ack_wait).await.unwrap().expect("job-1");
    assert_eq!((first.payload.as_slice(), first.deliveries), (&b"job-1"[..], 1));
    let second = bus.dequeue("prefill", wait, ack_wait).await.unwrap().expect("job-2");
    assert_eq!(second.payload, b"job-2");
    second.ack().await.unwrap();
    drop(first); // its consumer died before acknowledging
    let again = bus
        .dequeue("prefill", Duration::from_secs(5), ack_wait)
        .await
        .unwrap()
        .expect("redelivered");
    assert_eq!((again.payload.as_slice(), again.deliveries), (&b"job-1"[..], 2));
    again.ack().await.unwrap();
    assert!(
        bus.dequeue("prefill", Duration::from_millis(1500), ack_wait).await.unwrap().is_none(),
        "nothing left"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_control_plane() {
    discovery_scenario(Arc::new(MemoryDiscovery::new()), Duration::from_millis(500)).await;
    unique_names_scenario(Arc::new(MemoryDiscovery::new()), Duration::from_millis(500)).await;
    bus_scenario(Arc::new(MemoryBus::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_discovery() {
    let etcd = EtcdServer::start().unwrap();
    let d = EtcdDiscovery::connect(&[etcd.endpoint()], "test").await.unwrap();
    discovery_scenario(Arc::new(d.clone()), Duration::from_secs(2)).await;
    unique_names_scenario(Arc::new(d), Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_event_bus() {
    let nats = NatsServer::start().unwrap();
    let bus = NatsBus::connect(&nats.url(), "test").await.unwrap();
    bus_scenario(Arc::new(bus)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_is_survived_without_restarting_the_node() {
    let mut etcd = EtcdServer::start().unwrap();
    let d = EtcdDiscovery::connect(&[etcd.endpoint()], "test").await.unwrap();
    let reg = d.register(inst("node-a"), Duration::from_secs(2)).await.unwrap();
    let (_, mut watch) = d.watch("fabric").await.unwrap();
    etcd.restart().unwrap();
    // The registration is there after the restart (kept alive or re-registered) ...
    let start = Instant::now();
    loop {
        if let Ok(list) = d.list("fabric").await {
            if list.iter().any(|i| i.id == "node-a") {
                break;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(20), "node-a did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        d.list("fabric").await.unwrap().iter().any(|i| i.id == "node-a"),
        "and stays, past its TTL"
    );
    assert!(reg.is_alive());
    // ... and the watch resumed: a new node is seen.
    let _b = d.register(inst("node-b"), Duration::from_secs(2)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ev = next_event(&mut watch, deadline.saturating_duration_since(Instant::now())).await;
        if ev == DiscoveryEvent::Joined(inst("node-b")) {
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_is_survived_and_the_queue_is_durable() {
    let mut nats = NatsServer::start().unwrap();
    let bus = NatsBus::connect(&nats.url(), "test").await.unwrap();
    let mut sub = bus.subscribe("load").await.unwrap();
    bus.enqueue("prefill", b"kept".to_vec()).await.unwrap();
    nats.restart().unwrap();
    // The client reconnects and resubscribes by itself; publish until a message gets through.
    let start = Instant::now();
    loop {
        let _ = bus.publish("load", b"after".to_vec()).await;
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
            assert_eq!(m, b"after");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "no message after the restart");
    }
    let item =
        bus.dequeue("prefill", Duration::from_secs(5), Duration::from_secs(5)).await.unwrap();
    let item = item.expect("the queued item survived the restart");
    assert_eq!(item.payload, b"kept");
    item.ack().await.unwrap();
}

mod secured {
    //! etcd and NATS as operators secure them: TLS with client certificates from an in-test
    //! CA, and passwords. The right credentials work through the same scenarios; a wrong CA,
    //! an expired certificate or a wrong password is a clear error at connect, in bounded
    //! time.

    use super::*;
    use kvfabric::control::etcd::EtcdSecurity;
    use kvfabric::control::nats::{NatsAuth, NatsTls};
    use kvfabric::testkit::TestCa;
    use kvfabric::tls::client_config;

    /// A connect attempt that must fail: its error, within 15 s.
    async fn fails<T: std::fmt::Debug, E: std::fmt::Display>(
        what: &str,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> String {
        let start = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(15), f).await.unwrap_or_else(|_| {
            panic!("{what}: no answer within 15 s");
        });
        let e = r.expect_err(what).to_string();
        assert!(start.elapsed() < Duration::from_secs(15), "{what}");
        e
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_over_tls_with_client_certificates_and_a_password() {
        let ca = TestCa::new("etcd CA").unwrap();
        let etcd =
            EtcdServer::start_tls(ca.issue(&["127.0.0.1", "localhost"]).unwrap(), Some(ca.ca()))
                .unwrap();
        let client = ca.issue(&["kvfabric"]).unwrap();
        let tls = || Some(client_config(&ca.ca(), Some((&client.cert, &client.key))).unwrap());
        let password = "etcd-root-password-7f3a";
        etcd.enable_auth(EtcdSecurity { tls: tls(), user: None }, password).await.unwrap();
        let right = EtcdSecurity { tls: tls(), user: Some(("root".into(), password.into())) };
        let endpoints = [etcd.endpoint()];
        let d = EtcdDiscovery::connect_with(&endpoints, "secured", right.clone()).await.unwrap();
        discovery_scenario(Arc::new(d), Duration::from_secs(2)).await;

        let e = fails(
            "a wrong password",
            EtcdDiscovery::connect_with(
                &endpoints,
                "secured",
                EtcdSecurity { user: Some(("root".into(), "guess".into())), ..right.clone() },
            ),
        )
        .await;
        assert!(e.contains("authenticating to etcd as \"root\""), "{e}");
        let e = fails(
            "no user while authentication is on",
            EtcdDiscovery::connect_with(
                &endpoints,
                "secured",
                EtcdSecurity { tls: tls(), user: None },
            ),
        )
        .await;
        assert!(e.contains("etcd"), "{e}");
        let other = TestCa::new("another CA").unwrap();
        let e = fails(
            "a wrong CA",
            EtcdDiscovery::connect_with(
                &endpoints,
                "secured",
                EtcdSecurity {
                    tls: Some(
                        client_config(&other.ca(), Some((&client.cert, &client.key))).unwrap(),
                    ),
                    ..right.clone()
                },
            ),
        )
        .await;
        assert!(e.contains("not signed by the CA"), "{e}");
        let e = fails(
            "no client certificate",
            EtcdDiscovery::connect_with(
                &endpoints,
                "secured",
                EtcdSecurity { tls: Some(client_config(&ca.ca(), None).unwrap()), ..right.clone() },
            ),
        )
        .await;
        assert!(e.contains("TLS with etcd"), "{e}");
        let expired = ca.issue_expired(&["kvfabric"]).unwrap();
        let e =
            client_config(&ca.ca(), Some((&expired.cert, &expired.key))).unwrap_err().to_string();
        assert!(e.contains("valid only from"), "an expired client certificate: {e}");
        let plain = [etcd.endpoint().replace("https://", "http://")];
        let e = fails(
            "TLS options with an http:// endpoint",
            EtcdDiscovery::connect_with(&plain, "secured", right.clone()),
        )
        .await;
        assert!(e.contains("use https://"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_over_tls_with_client_certificates_and_a_password() {
        let ca = TestCa::new("NATS CA").unwrap();
        let password = "nats-password-91c2";
        let nats = NatsServer::start_tls(
            &ca.issue(&["127.0.0.1", "localhost"]).unwrap(),
            &ca.ca(),
            "kvfabric",
            password,
        )
        .unwrap();
        let client = ca.issue(&["kvfabric"]).unwrap();
        let tls = NatsTls {
            ca: Some(ca.ca()),
            identity: Some((client.cert.clone(), client.key.clone())),
        };
        let user = |p: &str| NatsAuth::UserPassword { user: "kvfabric".into(), password: p.into() };
        let bus = NatsBus::connect_secure(&nats.url(), user(password), tls.clone(), "secured")
            .await
            .unwrap();
        bus_scenario(Arc::new(bus)).await;

        fails(
            "a wrong password",
            NatsBus::connect_secure(&nats.url(), user("guess"), tls.clone(), "s"),
        )
        .await;
        let other = TestCa::new("another CA").unwrap();
        let wrong_ca = NatsTls { ca: Some(other.ca()), ..tls.clone() };
        fails("a wrong CA", NatsBus::connect_secure(&nats.url(), user(password), wrong_ca, "s"))
            .await;
        let no_cert = NatsTls { identity: None, ..tls.clone() };
        fails(
            "no client certificate",
            NatsBus::connect_secure(&nats.url(), user(password), no_cert, "s"),
        )
        .await;
        let expired = ca.issue_expired(&["kvfabric"]).unwrap();
        let old = NatsTls { identity: Some((expired.cert, expired.key)), ..tls.clone() };
        let e = fails(
            "an expired certificate",
            NatsBus::connect_secure(&nats.url(), user(password), old, "s"),
        )
        .await;
        assert!(e.contains("valid only from"), "{e}");
        fails("no TLS", NatsBus::connect_with(&nats.url(), user(password), "s")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nats_with_an_nkey() {
        let key = nkeys::KeyPair::new_user();
        let nats = NatsServer::start_with_nkey(&key.public_key()).unwrap();
        let seed = key.seed().unwrap();
        let bus =
            NatsBus::connect_with(&nats.url(), NatsAuth::NKey(seed.into()), "nkey").await.unwrap();
        bus_scenario(Arc::new(bus)).await;
        let other = nkeys::KeyPair::new_user().seed().unwrap();
        fails(
            "another NKey",
            NatsBus::connect_with(&nats.url(), NatsAuth::NKey(other.into()), "s"),
        )
        .await;
        fails("no credentials", NatsBus::connect(&nats.url(), "s")).await;
    }
}
