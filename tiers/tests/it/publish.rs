//! A store's KV events on the bus, numbered in one sequence with the engine's own (device
//! tier) events, and dumps that are exact as of the id they carry, answered only when they
//! name this store.

use std::sync::Arc;
use std::time::Duration;

use kvfabric::agent::{Agent, AgentConfig};
use kvfabric::contract::{self, Message};
use kvfabric::control::memory::MemoryBus;
use kvfabric::control::EventBus;
use kvfabric::events::{ChannelSink, KvEvent, KvEventData, KvEventSink, TierKind};
use kvfabric::hash::SequenceHash;
use kvfabric_tiers::publish::StorePublisher;
use kvfabric_tiers::{StoreConfig, TieredStore};
use tokio::sync::mpsc;

const BLOCK: u64 = 4096;

async fn next(rx: &mut mpsc::Receiver<Vec<u8>>) -> Message {
    let bytes = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a message within 5 s")
        .expect("bus open");
    Message::decode(&bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_numbered_once_and_dumps_answer_only_their_store() {
    let agent = Agent::start(AgentConfig::new("pub-test", b"s".to_vec())).await.unwrap();
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let mut heard = bus.subscribe(contract::KV_EVENTS).await.unwrap();
    let (sink, events) = ChannelSink::new(1024);
    let mut cfg = StoreConfig::new(BLOCK, 8);
    cfg.shared_host = false;
    let store = TieredStore::open(cfg, &agent, sink.clone()).await.unwrap();
    let _publisher =
        StorePublisher::start(bus.clone(), "w-0".into(), store.clone(), events).await.unwrap();

    store.put(SequenceHash(1), None, &[1u8; BLOCK as usize]).await.unwrap();
    // The engine's own block (device memory), through the same sink.
    sink.publish(KvEvent {
        event_id: 0,
        data: KvEventData::Stored {
            sequence_hashes: vec![SequenceHash(7)],
            parent: None,
            tier: TierKind::Device,
        },
    });
    store.put(SequenceHash(2), Some(SequenceHash(1)), &[2u8; BLOCK as usize]).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        match next(&mut heard).await {
            Message::KvEvent { source, event } => {
                assert_eq!(source, "w-0");
                ids.push(event.event_id);
            }
            other => panic!("expected an event, got {other:?}"),
        }
    }
    assert_eq!(ids, [1, 2, 3], "one sequence for the store's and the engine's events");

    // A request for another store is not ours to answer: the next message is our next event.
    let req = Message::DumpRequest { from: "router".into(), worker: "w-1".into() };
    bus.publish(req.topic(), req.encode()).await.unwrap();
    store.put(SequenceHash(3), Some(SequenceHash(2)), &[3u8; BLOCK as usize]).await.unwrap();
    match next(&mut heard).await {
        Message::KvEvent { event, .. } => assert_eq!(event.event_id, 4),
        other => panic!("expected event 4, got {other:?}"),
    }
    // Ours is answered, current as of the last id published.
    let req = Message::DumpRequest { from: "router".into(), worker: "w-0".into() };
    bus.publish(req.topic(), req.encode()).await.unwrap();
    match next(&mut heard).await {
        Message::KvDump { source, mut blocks, last_event_id } => {
            assert_eq!(source, "w-0");
            assert_eq!(last_event_id, 4);
            blocks.sort_by_key(|b| b.hash);
            let got: Vec<_> = blocks.iter().map(|b| (b.tier, b.hash, b.parent)).collect();
            assert_eq!(
                got,
                [
                    (TierKind::Host, SequenceHash(1), None),
                    (TierKind::Host, SequenceHash(2), Some(SequenceHash(1))),
                    (TierKind::Host, SequenceHash(3), Some(SequenceHash(2))),
                    (TierKind::Device, SequenceHash(7), None),
                ]
            );
        }
        other => panic!("expected the dump, got {other:?}"),
    }
    // Garbage on the request topic changes nothing; later events continue the sequence.
    bus.publish(contract::KV_DUMP_REQUEST, b"{not json".to_vec()).await.unwrap();
    assert!(store.remove(SequenceHash(2)).await);
    match next(&mut heard).await {
        Message::KvEvent { event, .. } => {
            assert_eq!(event.event_id, 5);
            assert!(matches!(event.data, KvEventData::Removed { .. }));
        }
        other => panic!("expected the removal, got {other:?}"),
    }
}
