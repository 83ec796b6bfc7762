//! sglang 0.5.23 beside sglang main on one kvx rank, decided per peer from what it sends: a
//! prefill engine facing two hand-made decodes (an 18-frame and a 20-frame registration) sends
//! the failure reason as a 4th status frame only to the second, answers a 5-frame `ABORT` with
//! the 4-frame `ABORT_ACK` and a 4-frame one with 3 frames, and refuses a DCP-mismatched
//! registration; a kvx decode sends a generation only to a prefill whose bootstrap sentinel
//! carries 0.5.23's keys, counts an `ABORT_ACK` only with the generation it sent, and refuses a
//! prefill of another allocation policy; `kvx prefill` registers its HTTP port.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use kvx_bootstrap::codec::AbortAck;
use kvx_bootstrap::http::{BootstrapClient, RetryPolicy};
use kvx_bootstrap::sockets::{Inbox, InboxConfig, InboxKind, PushCache, PushOptions, zmq};
use kvx_cli::config::ModelArgs;
use kvx_cli::decode::{self, DecodeConfig};
use kvx_cli::prefill_cmd::rank_registration;
use kvx_core::{
    Chunk, DecodeRegistration, Destination, Endpoint, KVPoll, PageSlice, Room, SessionId,
    TransferRequest,
};
use kvx_engine::engine::{PrefillConfig, PrefillEngine};
use kvx_engine::model::{KvLayout, ModelPreset};
use kvx_engine::synthetic::prefill_memory;
use kvx_engine::wire::{self, PrefillInbound};

const GUARD: Duration = Duration::from_secs(30);

/// A decode stand-in: a PULL inbox of its own and a PUSH to the prefill rank.
struct FakeDecode {
    inbox: zmq::Socket,
    push: zmq::Socket,
    me: Endpoint,
    session: SessionId,
}

impl FakeDecode {
    fn new(ctx: &zmq::Context, prefill: &Endpoint, session: &str) -> Self {
        let inbox = ctx.socket(zmq::PULL).unwrap();
        inbox.set_rcvtimeo(100).unwrap();
        inbox.bind("tcp://127.0.0.1:*").unwrap();
        let bound = inbox.get_last_endpoint().unwrap().unwrap();
        let port: u16 = bound.rsplit(':').next().unwrap().parse().unwrap();
        let push = ctx.socket(zmq::PUSH).unwrap();
        push.set_linger(0).unwrap();
        push.connect(&prefill.zmq_addr()).unwrap();
        FakeDecode {
            inbox,
            push,
            me: Endpoint::new("127.0.0.1", port),
            session: SessionId::new(session),
        }
    }

    fn registration(&self, layout: &KvLayout) -> DecodeRegistration {
        let base = 0x4000_0000u64;
        DecodeRegistration::plain(
            self.me.clone(),
            self.session.clone(),
            layout.kv_ptrs(base),
            layout.aux_ptrs(base + layout.pool_bytes()),
            layout.item_len,
        )
    }

    fn send(&self, frames: Vec<Vec<u8>>) {
        self.push.send_multipart(frames, 0).unwrap();
    }

    /// Metadata for `room`: one destination page, `page`.
    fn metadata(&self, room: Room, page: i32) -> Vec<Vec<u8>> {
        wire::encode_metadata(&TransferRequest {
            room,
            endpoint: self.me.clone(),
            session: self.session.clone(),
            dst: Some(Destination {
                kv_pages: vec![page],
                aux_index: 0,
                state_indices: vec![],
            }),
            required_dst_info_num: 1,
            decode_prefix_len: Some(0),
            device_kv_pages: vec![],
        })
        .unwrap()
    }

    /// The next message, raw.
    fn recv(&self) -> Vec<Vec<u8>> {
        let t0 = Instant::now();
        loop {
            match self.inbox.recv_multipart(0) {
                Ok(m) => return m,
                Err(zmq::Error::EAGAIN) => {
                    assert!(t0.elapsed() < GUARD, "hang guard: nothing from the prefill");
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}

fn strs(frames: &[Vec<u8>]) -> Vec<String> {
    frames
        .iter()
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect()
}

fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < GUARD, "hang guard: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Rows 5, 6, 7 and 10 on one prefill engine: the reason frame goes only to the decode whose
/// registration had frame 19; ACK forms follow the ABORT forms; DCP 1 with rank 1 is refused
/// (and its metadata then too, without a message to the endpoint it names).
#[test]
fn prefill_answers_each_decode_in_its_own_form() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let cfg = PrefillConfig {
        total_kv_heads: layout.total_kv_heads,
        ..PrefillConfig::default()
    };
    let engine = PrefillEngine::start(cfg, prefill_memory(&layout), rt.handle().clone()).unwrap();
    let ctx = zmq::Context::new();
    let k = FakeDecode::new(&ctx, engine.endpoint(), "127.0.0.1:1");
    let v = FakeDecode::new(&ctx, engine.endpoint(), "127.0.0.1:2");
    let dcp = FakeDecode::new(&ctx, engine.endpoint(), "127.0.0.1:3");
    let k_reg = wire::encode_registration(&k.registration(&layout)).unwrap();
    assert_eq!(k_reg.len(), 18);
    k.send(k_reg);
    let v_reg = wire::encode_registration(&DecodeRegistration {
        staging_slot_layer_ids: Some(vec![]),
        kv_item_lens: Some(vec![layout.item_len; layout.num_buffers]),
        ..v.registration(&layout)
    })
    .unwrap();
    assert_eq!(v_reg.len(), 20);
    v.send(v_reg);
    dcp.send(
        wire::encode_registration(&DecodeRegistration {
            dcp_rank: 1,
            ..dcp.registration(&layout)
        })
        .unwrap(),
    );

    // A room each, whose destination page is negative: its plan fails, and each decode is
    // told in the form it takes. The DCP-refused session is unknown to the prefill.
    let rooms = [(&k, 601u64, -1), (&v, 602, -1), (&dcp, 603, 0)];
    for &(d, n, page) in &rooms {
        let room = Room::new(n).unwrap();
        engine.open_room(room).unwrap();
        engine.init_room(room, 1, 0).unwrap();
        d.send(d.metadata(room, page));
    }
    wait("rooms 601 and 602 waiting for input", || {
        rooms[..2]
            .iter()
            .all(|&(_, n, _)| engine.poll(Room::new(n).unwrap()) == Some(KVPoll::WaitingForInput))
    });
    for &(_, n, _) in &rooms[..2] {
        let chunk = Chunk::new(PageSlice::new(0, 1).unwrap(), vec![3]).last();
        engine.send(Room::new(n).unwrap(), chunk).unwrap();
    }
    let to_k = k.recv();
    assert_eq!(
        strs(&to_k),
        ["601", "0", "0"],
        "a sglang main decode gets 3 frames"
    );
    let to_v = v.recv();
    assert_eq!(strs(&to_v[..3]), ["602", "0", "0"]);
    assert_eq!(to_v.len(), 4, "a 0.5.23 decode gets the reason frame");
    // The planner's reason, naming the room and the session.
    let reason = String::from_utf8(to_v[3].clone()).unwrap();
    assert!(
        reason.starts_with("Failed to plan kv transfer of 602 to 127.0.0.1:2"),
        "{reason}"
    );
    // The DCP-refused session is unknown: its metadata is refused and nothing goes to the
    // endpoint it named (its metadata reached the loop before the others' statuses left).
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        matches!(
            dcp.inbox.recv_multipart(zmq::DONTWAIT),
            Err(zmq::Error::EAGAIN)
        ),
        "an unregistered session was sent a message"
    );
    assert_eq!(
        engine.poll(Room::new(603).unwrap()),
        Some(KVPoll::Bootstrapping)
    );

    // ABORT forms: 5 frames ⇒ the 4-frame ACK echoing the generation; 4 frames ⇒ 3 frames.
    let room = Room::new(699).unwrap();
    k.send(wire::encode_abort(room, &k.me, Some(42)));
    assert_eq!(strs(&k.recv()), ["ABORT_ACK", "699", "0", "42"]);
    k.send(wire::encode_abort(room, &k.me, None));
    assert_eq!(strs(&k.recv()), ["ABORT_ACK", "699", "0"]);
    engine.shutdown();
}

/// Runs a kvx decode of two rooms against a fake prefill registered in sglang main's form or in
/// 0.5.23's; the prefill never sends a status, so both rooms time out and are ABORTed. It
/// answers the first ABORT with an ACK echoing its generation and the second with a stale one.
/// Returns (the ABORTs' generations, the decode's summary).
fn decode_against(v0523: bool) -> (Vec<Option<u64>>, decode::Summary) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let (server, port) = common::bootstrap_server(&rt);
    let ctx = zmq::Context::new();
    let mut inbox = Inbox::bind(&ctx, InboxConfig::new("127.0.0.1", InboxKind::Prefill)).unwrap();
    let args = ModelArgs {
        model: ModelPreset::Tiny,
        tp_size: 1,
        tp_rank: 0,
        page_size: 16,
        pool_pages: 64,
        kv_cache_dtype: "auto".into(),
    };
    let mut reg = rank_registration(&args, "127.0.0.1", inbox.endpoint().port);
    if v0523 {
        // What sglang 0.5.23's prefill adds to its PUT /route.
        reg.decode_allocation_policy = Some("early".into());
        reg.enable_kv_cache_sharding = Some(false);
    }
    let client = BootstrapClient::new("127.0.0.1", port).unwrap();
    rt.block_on(client.register_rank(&reg, &RetryPolicy::immediate(3, Duration::from_secs(5))))
        .unwrap();
    let cfg = DecodeConfig {
        requests: 2,
        concurrency: 2,
        prompt_tokens: (100, 100),
        waiting_timeout: Duration::from_millis(500),
        abort_release_timeout: Duration::from_secs(2),
        room_base: Some(700),
        ..DecodeConfig::new("127.0.0.1", port, layout)
    };
    let decode = rt.spawn(decode::run(cfg));
    let recv = |inbox: &mut Inbox| {
        let msg = rt
            .block_on(async { tokio::time::timeout(GUARD, inbox.recv()).await })
            .expect("hang guard: nothing from the decode")
            .unwrap();
        (
            msg.frames().len(),
            wire::parse_prefill_inbound(msg.frames()).unwrap(),
        )
    };
    let mut push = PushCache::new(&ctx, PushOptions::toward_decode(), 4);
    let mut generations = Vec::new();
    let mut aborts = 0;
    while aborts < 2 {
        match recv(&mut inbox) {
            (n, PrefillInbound::Registration(r)) => {
                // The kvx decode registers in 0.5.23's 20-frame form either way.
                assert_eq!(n, 20);
                assert!(r.accepts_status_reason());
            }
            (_, PrefillInbound::Metadata(_)) => {}
            (
                n,
                PrefillInbound::Abort {
                    room,
                    endpoint,
                    generation,
                },
            ) => {
                assert_eq!(n, if generation.is_some() { 5 } else { 4 });
                generations.push(generation);
                let echoed = if aborts == 0 {
                    generation
                } else {
                    // Another abort's generation (or one although none was sent).
                    Some(generation.map_or(1, |g| g + 100))
                };
                let ack = AbortAck {
                    room,
                    prefill_rank: Some(0),
                    generation: echoed,
                };
                push.send(&endpoint, &ack.encode()).unwrap();
                aborts += 1;
            }
            (_, other) => panic!("unexpected {other:?}"),
        }
    }
    let s = rt.block_on(decode).unwrap().unwrap();
    inbox.close();
    drop(server);
    (generations, s)
}

/// Row 8 and the decode side of row 7: generations only towards a 0.5.23 prefill, and an ACK
/// counts only when it echoes the room's generation (or names none, sglang main's form).
#[test]
fn decode_sends_generations_to_0523_prefills_and_matches_acks() {
    let (gens, s) = decode_against(true);
    assert!(gens.iter().all(Option::is_some), "{gens:?}");
    assert_ne!(gens[0], gens[1], "one generation per abort");
    assert_eq!((s.failed, s.aborted_rooms), (2, 2), "{s:?}");
    assert_eq!(
        s.abort_acked_rooms, 1,
        "the stale-generation ACK must not count: {s:?}"
    );

    let (gens, s) = decode_against(false);
    assert_eq!(
        gens,
        [None, None],
        "no generation towards a sglang main prefill"
    );
    // Without a generation sent, the second (generational) ACK cannot be this room's.
    assert_eq!((s.aborted_rooms, s.abort_acked_rooms), (2, 1), "{s:?}");
}

/// Row 1, decode side: a 0.5.23 sentinel is read, and its checks are those of 0.5.23's decode.
#[test]
fn decode_refuses_a_prefill_of_another_allocation_policy() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let layout = ModelPreset::Tiny.layout(1, 0, 16, 64);
    let (server, port) = common::bootstrap_server(&rt);
    let args = ModelArgs {
        model: ModelPreset::Tiny,
        tp_size: 1,
        tp_rank: 0,
        page_size: 16,
        pool_pages: 64,
        kv_cache_dtype: "auto".into(),
    };
    let mut reg = rank_registration(&args, "127.0.0.1", 1);
    reg.decode_allocation_policy = Some("prefill_complete".into());
    reg.enable_kv_cache_sharding = Some(false);
    let client = BootstrapClient::new("127.0.0.1", port).unwrap();
    rt.block_on(client.register_rank(&reg, &RetryPolicy::immediate(3, Duration::from_secs(5))))
        .unwrap();
    let err = rt
        .block_on(decode::run(DecodeConfig::new("127.0.0.1", port, layout)))
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("allocation policy mismatch: prefill=prefill_complete"),
        "{err:#}"
    );
    drop(server);
}

/// Row 2: `kvx prefill` registers the HTTP port it serves as `prefill_http_port`: the in-process
/// bootstrap server's, or its own `--metrics-port` when given.
#[test]
fn kvx_prefill_registers_its_http_port() {
    let sentinel = |port: u16| {
        let (_, body) = common::http_get(
            port,
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        )
        .unwrap();
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    let port = common::free_port();
    let p = common::start_prefill(port, &[], &[]);
    let t = sentinel(port);
    assert_eq!(t["prefill_http_port"], port, "{t}");
    // A sglang main registration: the sentinel keeps its 15 keys.
    assert_eq!(t.as_object().unwrap().len(), 15, "{t}");
    drop(p);
    let port = common::free_port();
    let metrics = common::free_port();
    let p = common::start_prefill(port, &["--metrics-port", &metrics.to_string()], &[]);
    let t = sentinel(port);
    assert_eq!(t["prefill_http_port"], metrics, "{t}");
    let (status, _) = common::http_get(metrics, "/metrics").unwrap();
    assert_eq!(status, 200);
    drop(p);
}
