use super::exchange::{Connect, QpAddr};
use crate::agent::{Agent, AgentConfig};
use crate::transfer::TransferError;
use crate::wire::ErrorCode;

#[test]
fn the_environment_chooses_the_device_or_turns_rdma_off() {
    use super::RdmaConfig;
    assert_eq!(RdmaConfig::from_values(None, None), Some(RdmaConfig::default()));
    assert_eq!(RdmaConfig::from_values(Some("auto"), None), Some(RdmaConfig::default()));
    assert_eq!(RdmaConfig::from_values(Some("off"), Some("3")), None);
    let c = RdmaConfig::from_values(Some("mlx5_1"), Some("3")).unwrap();
    assert_eq!((c.device.as_deref(), c.gid_index), (Some("mlx5_1"), Some(3)));
    assert_eq!(RdmaConfig::from_values(None, Some("x")).unwrap().gid_index, None);
    let given = |k: &str| match k {
        "KVFABRIC_RDMA" => Some("mlx5_2".to_string()),
        "KVFABRIC_RDMA_TRAFFIC_CLASS" => Some("106".to_string()),
        "KVFABRIC_RDMA_SERVICE_LEVEL" => Some("many".to_string()),
        _ => None,
    };
    let c = RdmaConfig::from_settings(given).unwrap();
    assert_eq!((c.device.as_deref(), c.traffic_class, c.service_level), (Some("mlx5_2"), 106, 0));
    assert_eq!(RdmaConfig::from_settings(|_| None), Some(RdmaConfig::default()));
}

/// Over a real session: an agent without a device answers a connect with a typed refusal
/// (and the session stays usable); the exchange needs the secret like everything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_to_an_agent_without_a_device_is_refused_typed() {
    if super::availability().is_ok() {
        eprintln!("SKIPPED: this host has an RDMA device (the hardware tests cover it)");
        return;
    }
    let a = Agent::start(AgentConfig::new("a", b"k".to_vec())).await.unwrap();
    let b = Agent::start(AgentConfig::new("b", b"k".to_vec())).await.unwrap();
    a.load_peer(b.metadata()).unwrap();
    let peer = a.peer("b").unwrap();
    let connect = Connect {
        qps: vec![QpAddr { lid: 1, gid: [0; 16], qpn: 5, psn: 6, mtu: 5, rd_atomic: 1 }],
    };
    let e = peer.session.rdma_connect(&connect).await.unwrap_err();
    assert!(
        matches!(&e, TransferError::Remote { code: ErrorCode::Unavailable, message } if message.contains("no RDMA device")),
        "{e}"
    );
    // The same session still answers.
    assert_eq!(peer.session.checksums(Vec::new()).await.unwrap(), Vec::<u64>::new());

    // Without the secret, no exchange at all.
    let c = Agent::start(AgentConfig::new("c", b"other".to_vec())).await.unwrap();
    c.load_peer(b.metadata()).unwrap();
    let e = c.peer("b").unwrap().session.rdma_connect(&connect).await.unwrap_err();
    assert!(matches!(e, TransferError::Auth(_)), "{e}");
}
