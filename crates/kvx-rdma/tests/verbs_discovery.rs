//! Device discovery with the `verbs` feature on: on a host without RDMA it must return the
//! typed "no device" error (never panic); on a host with devices it lists them.
#![cfg(feature = "verbs")]

use std::path::Path;

use kvx_rdma::verbs::{DeviceConfig, VerbsConfig, VerbsError, VerbsTransport, discover};

/// True when the kernel exposes verbs devices (`/sys/class/infiniband` has entries).
fn host_has_devices() -> bool {
    Path::new("/sys/class/infiniband")
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some())
}

#[test]
fn discovery_reports_no_device_as_a_typed_error() {
    let r = discover();
    eprintln!("verbs discovery on this host: {r:?}");
    if host_has_devices() {
        // a host with devices may still lack libibverbs (EOPNOTSUPP): that is "no device" too
        match r {
            Ok(names) => assert!(!names.is_empty()),
            Err(e) => assert!(matches!(e, VerbsError::NoDevice { .. }), "{e}"),
        }
    } else {
        match r {
            Err(VerbsError::NoDevice { reason }) => {
                assert!(reason.starts_with("ibv_get_device_list: "), "{reason}");
            }
            other => panic!("expected NoDevice on a host without RDMA, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn opening_the_transport_without_a_device_fails_cleanly() {
    if host_has_devices() {
        eprintln!("skipping: this host has verbs devices");
        return;
    }
    let cfg = VerbsConfig {
        device: DeviceConfig {
            name: Some("mlx5_0".into()),
            ..DeviceConfig::default()
        },
        listen: Some("127.0.0.1:0".into()),
        ..VerbsConfig::default()
    };
    let e = VerbsTransport::open(cfg).await.expect_err("no device here");
    assert!(matches!(e, VerbsError::NoDevice { .. }), "{e}");
    assert_eq!(e.label(), "no_device");
    let te = kvx_rdma::verbs::session::to_transport_error(e, "peer");
    assert!(matches!(te, kvx_rdma::TransportError::NoDevice(_)));
}
