//! Hostile input and aborts while real rooms run: garbage and truncated ZMQ messages at the
//! prefill's and the decode's inboxes, junk at the decode's transport port and at the bootstrap
//! server (`malformed-flood`); rooms that time out mid-transfer and are ABORTed while the decode
//! reuses their pages (`abort-drain`).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result};

use super::common::{self, DecodeOpts, Model, PrefillOpts, Summary};
use crate::integration::metrics::{Absent, Metrics};
use crate::integration::zmtp::Push;
use crate::integration::{Ctx, Verdict};

/// Removes terminal colour sequences from a log.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The value after `key=` on a log line (up to the next space).
pub(crate) fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let i = line.find(&format!("{key}="))?;
    line[i + key.len() + 1..].split_whitespace().next()
}

/// Every payload the flood sends to a ZMQ inbox: wrong frame counts, non-numeric rooms,
/// truncated registrations, odd index lengths, huge and empty frames.
fn garbage_messages(seed: u64) -> Vec<Vec<Vec<u8>>> {
    let mut x = seed | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out: Vec<Vec<Vec<u8>>> = vec![
        vec![b"".to_vec()],
        vec![b"None".to_vec()],
        vec![b"None".to_vec(), b"10.0.0.1".to_vec(), b"12345".to_vec()],
        vec![b"None".to_vec(); 12],
        vec![
            b"not-a-room".to_vec(),
            b"x".to_vec(),
            b"1".to_vec(),
            b"s".to_vec(),
        ],
        vec![b"-5".to_vec(); 7],
        vec![
            b"123".to_vec(),
            b"10.0.0.1".to_vec(),
            b"1".to_vec(),
            b"s".to_vec(),
            vec![1, 2, 3],
            vec![9; 5],
        ],
        vec![b"ABORT".to_vec()],
        vec![
            b"99999999999999999999999".to_vec(),
            b"KVPoll.Success".to_vec(),
        ],
        vec![vec![0xFF; 4096], vec![0; 70_000]],
    ];
    for _ in 0..200 {
        let n = (rnd() % 9) as usize;
        let frames = (0..n)
            .map(|_| {
                let len = (rnd() % 48) as usize;
                (0..len).map(|_| rnd() as u8).collect()
            })
            .collect();
        out.push(frames);
    }
    out
}

/// Sends the garbage to a ZMQ inbox, then broken ZMTP (bad frame header, truncated greeting).
fn flood_inbox(addr: SocketAddr, seed: u64) -> Result<usize> {
    let mut sent = 0;
    let mut push = Push::connect(addr)?;
    for m in garbage_messages(seed) {
        let frames: Vec<&[u8]> = m.iter().map(Vec::as_slice).collect();
        if frames.is_empty() {
            continue;
        }
        push.send(&frames)?;
        sent += 1;
    }
    push.close(Duration::from_millis(300));
    // A frame header promising more than will ever come, then the close.
    let mut push = Push::connect(addr)?;
    push.raw(&[0x02, 0, 0, 0, 0, 0, 1, 0, 0, b'x'])?;
    push.close(Duration::from_millis(100));
    // Not ZMTP at all, and a greeting cut short.
    for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0xFF, 0, 0, 0, 0][..]] {
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let _ = s.write_all(junk);
        }
    }
    Ok(sent)
}

/// Junk at a plain TCP port: random bytes, a truncated header, an immediate close.
fn flood_tcp(addr: SocketAddr, seed: u64) -> usize {
    let mut n = 0;
    for i in 0..20u64 {
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let len = (seed.wrapping_mul(i + 1) % 200) as usize;
            let junk: Vec<u8> = (0..len).map(|k| (k as u64 ^ seed ^ i) as u8).collect();
            let _ = s.write_all(&junk);
            n += 1;
        }
    }
    n
}

/// Junk at the bootstrap server: not HTTP, a body cut short, bad JSON for `PUT /route`.
fn flood_http(addr: SocketAddr) -> usize {
    let reqs: [&[u8]; 4] = [
        b"\x00\x01garbage\r\n\r\n",
        b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"role\":",
        b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 9\r\nConnection: close\r\n\r\n{\"a\": [1,",
        b"GET /route?engine_rank=abc&target_dp_group=-1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ];
    let mut n = 0;
    for r in reqs {
        if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            let _ = s.write_all(r);
            n += 1;
        }
    }
    n
}

/// `malformed-flood`: garbage at every inbox and port from a third host while real rooms run.
pub fn malformed_flood(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(
        ctx,
        &[
            "bootstrap",
            "prefill --metrics-port",
            "decode --summary-json",
        ],
    ) {
        return Ok(v);
    }
    // The rooms run slowly (a pause before each batch) so that the flood meets them in flight.
    if let Some(v) = super::need_failpoints(ctx, &[crate::integration::kvx::FAILPOINTS[0]]) {
        return Ok(v);
    }
    let model = Model::new("llama3-8b", 160);
    let mut boot = common::bootstrap(ctx, 0)?;
    let popts = PrefillOpts {
        env: vec![(
            "FAILPOINTS".into(),
            "kvx::transfer_worker::batch=sleep(100)".into(),
        )],
        ..PrefillOpts::default()
    };
    let mut p = common::prefill(ctx, "prefill", 0, boot.addr, &model, 0, &popts)?;
    let mut o = DecodeOpts::new(common::sized(ctx, 16, 100), 256);
    o.concurrency = 4;
    let mut d = common::decode(ctx, "decode", 1, boot.addr, &model, &o)?;
    if !p.proc.wait_for_log("decode registered", common::READY) {
        return Ok(Verdict::Fail("the decode never registered".into()));
    }
    let plog = strip_ansi(&p.proc.log_text());
    let inbox: SocketAddr = plog
        .lines()
        .find_map(|l| {
            l.split("inbox tcp://")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .context("prefill inbox endpoint not in its log")?;
    let reg = plog
        .lines()
        .find(|l| l.contains("decode registered"))
        .context("no registration line")?;
    let decode_inbox: SocketAddr = field(reg, "endpoint")
        .and_then(|s| s.parse().ok())
        .context("decode endpoint")?;
    // The session id is `host:port#instance`: the data plane listens on the address part.
    let decode_data: SocketAddr = field(reg, "session")
        .and_then(|s| s.split('#').next()?.parse().ok())
        .context("decode session")?;
    let before = ctx.scrape(0, p.metrics)?;
    let boot_addr = boot.addr;
    let sent = ctx.on_host(2, move || -> Result<(usize, usize, usize, usize)> {
        Ok((
            flood_inbox(inbox, 1)?,
            flood_inbox(decode_inbox, 2)?,
            flood_tcp(decode_data, 3),
            flood_http(boot_addr),
        ))
    })??;
    let (code, s) = d.finish(Duration::from_secs(180))?;
    // What the prefill dropped as malformed or ignored since the flood began; a counter absent
    // before the flood had counted nothing yet.
    let dropped = |m: &Metrics| -> Result<f64, Absent> {
        Ok(m.get("kvx_malformed_frames_total")? + m.events("kvx_ignored_messages_total", &[]))
    };
    let baseline = before.events("kvx_malformed_frames_total", &[])
        + before.events("kvx_ignored_messages_total", &[]);
    let want = sent.0 as f64;
    let (after, _) = common::wait_metrics(ctx, 0, p.metrics, Duration::from_secs(5), |m| {
        dropped(m).is_ok_and(|n| n - baseline >= want)
    })?;
    let left = common::drained(ctx, &p, Duration::from_secs(5))?;
    let alive = p.proc.try_wait().is_none() && boot.proc.try_wait().is_none();
    Ok(flood_verdict(&FloodSeen {
        sent,
        prefill_counted: dropped(&after)
            .map(|n| n - baseline)
            .map_err(|e| e.to_string()),
        decode: (code, s),
        left,
        alive,
    }))
}

/// What `malformed-flood` saw.
#[derive(Debug, Clone)]
pub(crate) struct FloodSeen {
    /// Garbage messages sent to the prefill's inbox and the decode's, junk connections to the
    /// decode's transport port and requests to the bootstrap server.
    pub sent: (usize, usize, usize, usize),
    /// Messages the prefill counted as malformed or ignored during the flood (an error when its
    /// counter is absent).
    pub prefill_counted: Result<f64, String>,
    /// The decode's exit code and summary.
    pub decode: (i32, Summary),
    /// Room entries left on the prefill.
    pub left: f64,
    /// Prefill and bootstrap server still running.
    pub alive: bool,
}

/// `malformed-flood`'s verdict: every garbage message counted by the inbox it was sent to (the
/// garbage is seeded and holds no valid message), every room verified, nothing left, nobody dead.
pub(crate) fn flood_verdict(x: &FloodSeen) -> Verdict {
    let (code, s) = &x.decode;
    let sent = x.sent;
    let prefill_counted = x.prefill_counted.clone().unwrap_or(-1.0);
    let figures = format!(
        "sent {} garbage messages to the prefill inbox, {} to the decode inbox, {} junk connections to the transport port, {} to the bootstrap server; prefill counted {}, decode {}; {}; room entries left {}; exit {code}; prefill and bootstrap alive: {}",
        sent.0,
        sent.1,
        sent.2,
        sent.3,
        match &x.prefill_counted {
            Ok(n) => n.to_string(),
            Err(e) => e.clone(),
        },
        s.dropped_messages,
        s.figures(),
        x.left,
        x.alive
    );
    let checks = [
        (sent.0 > 0 && sent.1 > 0, "no garbage was sent".to_string()),
        (
            prefill_counted >= sent.0 as f64,
            "the prefill did not count every garbage message sent to it".into(),
        ),
        (
            s.dropped_messages >= sent.1 as u64,
            "the decode did not count every garbage message sent to it".into(),
        ),
        (
            *code == 0 && s.verified == s.requests && s.requests > 0,
            "rooms did not all verify".into(),
        ),
        (x.left == 0.0, "room entries left on the prefill".into()),
        (x.alive, "the prefill or the bootstrap server died".into()),
    ];
    super::faults::verdict(&checks, figures)
}

/// Every `N`th batch of `abort-drain` fails its room mid-flight (the per-room failpoint, off in
/// between), `INJECTED` times: some of the room's batches written, the rest still queued.
const FAIL_EVERY: usize = 6;
/// Rooms `abort-drain` fails mid-flight.
const INJECTED: usize = 3;
/// Bandwidth cap (Mbit/s) on the prefill host of an `abort-drain` run with separate hosts: a 2 MiB
/// batch then spends about 100 ms on the wire.
const WIRE_MBIT: u32 = 160;

/// What `abort-drain` saw.
#[derive(Debug, Clone)]
pub(crate) struct AbortDrainSeen {
    /// The decode's exit code and summary.
    pub decode: (i32, Summary),
    /// ABORTs the prefill received (`kvx_aborts_total`).
    pub aborts: Result<f64, String>,
    /// Rooms the prefill logged as failed by the injected mid-flight fault.
    pub injected: usize,
    /// Seconds the prefill spent with a batch on the wire (`kvx_batch_latency_seconds_sum`: the
    /// time from handing a batch to the transport until the decode confirmed it).
    pub wire_s: Result<f64, String>,
    /// Room entries left on the prefill.
    pub left: f64,
    /// The run had separate hosts (a capped, slow link); on loopback the wire is too fast to
    /// show that an ABORT met a batch on it.
    pub hosts: bool,
}

impl AbortDrainSeen {
    /// Share of the run during which a batch was on the wire (one decode session: one worker
    /// writes at a time).
    fn wire_share(&self) -> f64 {
        let run = self.decode.1.seconds;
        match &self.wire_s {
            Ok(w) if run > 0.0 => (w / run).clamp(0.0, 1.0),
            _ => 0.0,
        }
    }
}

/// `abort-drain`'s verdict. Rooms time out mid-transfer and are ABORTed: each ABORT is
/// acknowledged by every prefill rank and no write lands in the room's pages after the ACK
/// (the decode hashes them at the ACK and after); the ABORTs came while batches were on the
/// wire — the wire was busy for a share `w` of the run, so the chance that none of `n` ABORTs
/// found a batch on the wire, `(1 - w)^n`, must be under 1/1000; batches failed mid-flight by the
/// per-room failpoint failed their rooms (seen by the decode); later rooms reusing every page
/// verified.
pub(crate) fn abort_drain_verdict(x: &AbortDrainSeen) -> Verdict {
    let (code, s) = &x.decode;
    let timed_out: u64 = s
        .failure_reasons
        .iter()
        .filter(|(r, _)| r.contains("timed out"))
        .map(|(_, n)| *n)
        .sum();
    let injected_seen: u64 = s
        .failure_reasons
        .iter()
        .filter(|(r, _)| r.contains("injected per-room fault"))
        .map(|(_, n)| *n)
        .sum();
    let aborts = x.aborts.clone().unwrap_or(0.0);
    let share = x.wire_share();
    let missed = (1.0 - share).powf(s.aborted_rooms as f64);
    let figures = format!(
        "{}; {timed_out} rooms timed out, the decode ABORTed {} and got every rank's ABORT_ACK for {}, {} late writes after an ACK; prefill received {}; a batch on the wire {:.0} % of the run (chance no ABORT met one {missed:.1e}); {} rooms failed mid-flight by the prefill, {injected_seen} seen so by the decode; room entries left {}; decode exit {code}",
        s.figures(),
        s.aborted_rooms,
        s.abort_acked_rooms,
        s.late_writes,
        match &x.aborts {
            Ok(n) => format!("{n} ABORTs"),
            Err(e) => e.clone(),
        },
        share * 100.0,
        x.injected,
        x.left,
    );
    let on_wire = missed <= 1e-3;
    let checks = [
        (
            timed_out > 0 && aborts >= 1.0 && s.aborted_rooms >= timed_out,
            "no room was aborted mid-transfer".to_string(),
        ),
        (
            s.abort_acked_rooms == s.aborted_rooms,
            "an ABORT was not acknowledged by every prefill rank".into(),
        ),
        (
            s.late_writes == 0,
            "a write landed after an ABORT_ACK".into(),
        ),
        (
            on_wire || !x.hosts,
            "the ABORTs need not have met a batch on the wire".into(),
        ),
        (
            x.injected > 0 && injected_seen > 0 && injected_seen <= x.injected as u64,
            "no batch failed mid-flight (or the decode was not told)".into(),
        ),
        (
            s.corrupt == 0 && s.all_terminal() && s.verified > 0,
            "later rooms did not all verify".into(),
        ),
        (x.left == 0.0, "room entries left on the prefill".into()),
    ];
    match super::faults::verdict(&checks, figures) {
        // Every other check held, but loopback cannot show the ABORTs met batches on the wire:
        // said, not passed (a FAIL where separate hosts are required).
        Verdict::Pass(figures) if !on_wire => Verdict::Skip(format!(
            "on loopback no ABORT can be shown to meet a batch on the wire (it needs the capped link of separate hosts); every other check held: {figures}"
        )),
        v => v,
    }
}

/// `abort-drain`: rooms that outlive the decode's waiting timeout mid-transfer are ABORTed while
/// batches are on the wire (on separate hosts the prefill's link is capped so that each batch
/// spends about 100 ms there); the prefill acknowledges each ABORT only once its writes drained:
/// the decode holds each aborted room's pages until its ACK, checks that they do not change
/// afterwards (no late write), then hands them to later rooms, which all verify. A few batches
/// fail mid-flight through the per-room failpoint, failing their rooms.
pub fn abort_drain(ctx: &mut Ctx) -> Result<Verdict> {
    if let Some(v) = super::need(
        ctx,
        &[
            "bootstrap",
            "prefill --max-batch-mib",
            "decode --waiting-timeout",
        ],
    ) {
        return Ok(v);
    }
    let (batch, chunk) = (
        crate::integration::kvx::FAILPOINTS[0],
        crate::integration::kvx::FAILPOINTS[1],
    );
    if let Some(v) = super::need_failpoints(ctx, &[batch, chunk]) {
        return Ok(v);
    }
    let boot = common::bootstrap(ctx, 0)?;
    let fail_some = vec![format!("{}*off->1*return(abort-drain)", FAIL_EVERY - 1); INJECTED];
    // Batches must spend most of the run on the wire: 2 MiB batches on a link capped so that
    // each takes about 100 ms there, with a 60 ms pause before each, so that a 256-token room
    // takes about 2 s and rooms time out after 2 s. Loopback has no slow wire: the same run
    // there shows everything but that (see the verdict).
    // A small pool: aborted rooms' pages are handed to later rooms.
    let model = Model::new("llama3-8b", 48);
    let popts = PrefillOpts {
        extra: common::args(&["--max-batch-mib", "2"]),
        env: vec![(
            "FAILPOINTS".into(),
            format!("{batch}=sleep(60);{chunk}={}", fail_some.join("->")),
        )],
        ..PrefillOpts::default()
    };
    let p = common::prefill(ctx, "prefill", 0, boot.addr, &model, 0, &popts)?;
    if let Some(t) = ctx.topology() {
        t.cap_bandwidth(0, Some(WIRE_MBIT))?;
    }
    let mut o = DecodeOpts::new(common::sized(ctx, 24, 80), 16);
    o.tokens_max = Some(480);
    o.concurrency = 3;
    o.extra = common::args(&["--waiting-timeout", "2"]);
    let mut d = common::decode(ctx, "decode", 1, boot.addr, &model, &o)?;
    let decode = d.finish(Duration::from_secs(common::sized(ctx, 170, 280) as u64))?;
    let m = ctx.scrape(0, p.metrics)?;
    let left = common::drained(ctx, &p, Duration::from_secs(10))?;
    Ok(abort_drain_verdict(&AbortDrainSeen {
        decode,
        aborts: m.get("kvx_aborts_total").map_err(|e| e.to_string()),
        injected: super::faults::failed_rooms(
            &p.proc.log_text(),
            0,
            "injected per-room fault: abort-drain",
        )
        .len(),
        wire_s: m
            .get("kvx_batch_latency_seconds_sum")
            .map_err(|e| e.to_string()),
        left,
        hosts: ctx.topology().is_some(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fails(v: &Verdict, why: &str) {
        match v {
            Verdict::Fail(t) => assert!(t.contains(why), "{why:?} not in {t}"),
            v => panic!("expected a FAIL for {why:?}, got {v:?}"),
        }
    }

    fn ok_decode(requests: u64) -> Summary {
        Summary {
            requests,
            succeeded: requests,
            verified: requests,
            ..Summary::default()
        }
    }

    fn flood_seen() -> FloodSeen {
        let mut s = ok_decode(16);
        s.dropped_messages = 188;
        FloodSeen {
            sent: (187, 188, 20, 4),
            prefill_counted: Ok(187.0),
            decode: (0, s),
            left: 0.0,
            alive: true,
        }
    }

    #[test]
    fn flood_fails_unless_the_prefill_counted_every_message() {
        assert!(matches!(flood_verdict(&flood_seen()), Verdict::Pass(_)));
        let mut x = flood_seen();
        x.prefill_counted = Ok(186.0);
        fails(&flood_verdict(&x), "the prefill did not count every");
        let mut x = flood_seen();
        x.prefill_counted = Err("metric kvx_malformed_frames_total absent from /metrics".into());
        fails(&flood_verdict(&x), "absent from /metrics");
        let mut x = flood_seen();
        x.decode.1.dropped_messages = 10;
        fails(&flood_verdict(&x), "the decode did not count every");
        let mut x = flood_seen();
        x.alive = false;
        fails(&flood_verdict(&x), "died");
    }

    fn abort_seen() -> AbortDrainSeen {
        let mut s = ok_decode(24);
        s.succeeded = 5;
        s.verified = 5;
        s.failed = 19;
        s.seconds = 28.0;
        s.aborted_rooms = 16;
        s.abort_acked_rooms = 16;
        s.failure_reasons = vec![
            (
                "Request timed out after 2.0s in KVPoll.WaitingForInput".into(),
                16,
            ),
            ("injected per-room fault: abort-drain".into(), 3),
        ];
        AbortDrainSeen {
            decode: (1, s),
            aborts: Ok(16.0),
            injected: 3,
            wire_s: Ok(14.0),
            left: 0.0,
            hosts: true,
        }
    }

    #[test]
    fn abort_drain_fails_on_a_late_write_an_idle_wire_or_no_midflight_failure() {
        assert!(matches!(
            abort_drain_verdict(&abort_seen()),
            Verdict::Pass(_)
        ));
        let mut x = abort_seen();
        x.decode.1.late_writes = 1;
        fails(
            &abort_drain_verdict(&x),
            "a write landed after an ABORT_ACK",
        );
        let mut x = abort_seen();
        x.decode.1.abort_acked_rooms = 15;
        fails(&abort_drain_verdict(&x), "not acknowledged");
        // A wire busy 5 % of the run: 16 ABORTs may all have come between batches.
        let mut x = abort_seen();
        x.wire_s = Ok(1.4);
        fails(&abort_drain_verdict(&x), "on the wire");
        let mut x = abort_seen();
        x.wire_s = Err("metric kvx_batch_latency_seconds_sum absent from /metrics".into());
        fails(&abort_drain_verdict(&x), "on the wire");
        // The mid-flight failpoint disabled.
        let mut x = abort_seen();
        x.injected = 0;
        x.decode.1.failure_reasons.pop();
        fails(&abort_drain_verdict(&x), "no batch failed mid-flight");
        let mut x = abort_seen();
        x.aborts = Err("metric kvx_aborts_total absent from /metrics".into());
        fails(&abort_drain_verdict(&x), "no room was aborted");
        // Loopback: said, never passed; any other broken check still fails.
        let mut x = abort_seen();
        x.hosts = false;
        x.wire_s = Ok(1.4);
        assert!(matches!(abort_drain_verdict(&x), Verdict::Skip(_)));
        x.decode.1.late_writes = 1;
        fails(&abort_drain_verdict(&x), "a write landed");
    }
}
