//! Client↔server tests over loopback: every query, waits woken across clients, and a server
//! that survives garbage, absurd lengths, half frames, stalls and vanished clients.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use super::protocol::{query, Request, VALIDATION_MAGIC};
use super::*;

const DEADLINE: Duration = Duration::from_secs(10);

struct TestServer {
    handle: Option<StoreHandle>,
    addr: String,
    rt: tokio::runtime::Runtime,
}

impl TestServer {
    fn start() -> Self {
        Self::start_with(ServerConfig::default())
    }

    fn start_with(config: ServerConfig) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime builds");
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        let handle = rt.block_on(StoreServer::start_with_config(any, config)).expect("server binds loopback");
        let addr = handle.local_addr().to_string();
        TestServer { handle: Some(handle), addr, rt }
    }

    fn handle(&self) -> &StoreHandle {
        self.handle.as_ref().expect("server is running")
    }

    fn client(&self) -> StoreClient {
        StoreClient::connect(&self.addr, DEADLINE).expect("client connects")
    }

    /// A raw socket that has passed validation.
    fn raw(&self) -> TcpStream {
        let mut s = TcpStream::connect(&self.addr).expect("raw connect");
        s.set_read_timeout(Some(DEADLINE)).expect("read timeout");
        let mut frame = Vec::new();
        Request::Validate { magic: VALIDATION_MAGIC }.encode(&mut frame);
        s.write_all(&frame).expect("validate");
        s
    }

    /// Polls an in-process condition until it holds or the deadline passes.
    fn eventually(&self, what: &str, mut cond: impl FnMut(&StoreHandle) -> bool) {
        let start = Instant::now();
        while !cond(self.handle()) {
            assert!(start.elapsed() < DEADLINE, "timed out waiting until {what}");
            thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            let _ = self.rt.block_on(async { tokio::time::timeout(DEADLINE, handle.shutdown()).await });
        }
    }
}

fn encode(request: Request) -> Vec<u8> {
    let mut frame = Vec::new();
    request.encode(&mut frame);
    frame
}

/// Asserts the server closed `s` (EOF or reset) within the deadline.
fn assert_closed_by_server(s: &mut TcpStream) {
    let mut buf = [0u8; 64];
    let start = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("server did not close the connection within {DEADLINE:?}")
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => assert!(start.elapsed() < DEADLINE, "server kept talking"),
        }
    }
}

fn spawn_with_deadline<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> thread::JoinHandle<T> {
    thread::spawn(f)
}

fn join<T>(h: thread::JoinHandle<T>) -> T {
    let start = Instant::now();
    while !h.is_finished() {
        assert!(start.elapsed() < DEADLINE, "thread did not finish within {DEADLINE:?}");
        thread::sleep(Duration::from_millis(2));
    }
    h.join().expect("thread did not panic")
}

#[test]
fn store_every_query_round_trips_between_client_and_server() {
    let server = TestServer::start();
    let mut c = server.client();
    c.ping().expect("ping");
    c.set("k", b"v1").expect("set");
    assert_eq!(c.get("k").expect("get"), b"v1");
    assert_eq!(c.add("n", 5).expect("add"), 5);
    assert_eq!(c.add("n", -2).expect("add"), 3);
    assert_eq!(c.get("n").expect("get counter"), b"3");
    assert_eq!(c.compare_set("k", b"v1", b"v2").expect("cas hit"), b"v2");
    assert_eq!(c.compare_set("k", b"zz", b"v3").expect("cas miss"), b"v2");
    assert_eq!(c.compare_set("fresh", b"", b"new").expect("cas create"), b"new");
    assert_eq!(c.compare_set("absent", b"x", b"y").expect("cas absent"), b"x");
    assert!(c.check(&["k", "n"]).expect("check"));
    assert!(!c.check(&["k", "absent"]).expect("check"));
    c.wait(&["k", "n"], Duration::from_millis(100)).expect("wait on present keys");
    assert_eq!(c.num_keys().expect("num_keys"), 3);
    assert!(c.delete_key("fresh").expect("delete"));
    assert!(!c.delete_key("fresh").expect("delete again"));
    c.append("k", b"++").expect("append");
    c.append("new", b"a").expect("append creates");
    assert_eq!(c.get("k").expect("get"), b"v2++");
    c.multi_set(&[("a", b"1".as_slice()), ("b", b"".as_slice())]).expect("multi_set");
    assert_eq!(c.multi_get(&["b", "a", "k"]).expect("multi_get"), vec![b"".to_vec(), b"1".to_vec(), b"v2++".to_vec()]);
    let mut keys = c.list_keys().expect("list_keys");
    keys.sort();
    assert_eq!(keys, vec!["a", "b", "k", "n", "new"]);
    c.queue_push("q", b"x").expect("push");
    c.queue_push("q", b"y").expect("push");
    assert_eq!(c.queue_len("q").expect("len"), 2);
    assert_eq!(c.queue_pop("q", true).expect("pop"), Some(b"x".to_vec()));
    assert_eq!(c.queue_pop("q", false).expect("pop"), Some(b"y".to_vec()));
    assert_eq!(c.queue_pop("q", false).expect("pop empty"), None);
    c.barrier("bar", 1, Duration::from_secs(1)).expect("barrier of one");
    assert_eq!(server.handle().num_keys(), 6);
}

#[test]
fn store_large_value_round_trips_intact() {
    let server = TestServer::start();
    let mut c = server.client();
    let value: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    c.set("big", &value).expect("set 8 MiB");
    assert!(c.get("big").expect("get 8 MiB") == value);
    c.append("big", b"tail").expect("append");
    assert_eq!(c.multi_get(&["big"]).expect("multi_get")[0].len(), value.len() + 4);
}

#[test]
fn store_get_waits_for_a_key_set_later_by_another_client() {
    let server = TestServer::start();
    let mut reader = server.client();
    let mut writer = server.client();
    let getter = spawn_with_deadline(move || reader.get("late").expect("get waits"));
    thread::sleep(Duration::from_millis(100));
    assert!(!getter.is_finished(), "get returned before the key existed");
    writer.set("late", b"here").expect("set");
    assert_eq!(join(getter), b"here");
}

#[test]
fn store_concurrent_waits_are_woken_by_sets_and_adds_from_other_clients() {
    let server = TestServer::start();
    let n = 16;
    let ready = Arc::new(Barrier::new(n + 1));
    let waiters: Vec<_> = (0..n)
        .map(|i| {
            let mut c = server.client();
            let ready = ready.clone();
            spawn_with_deadline(move || {
                ready.wait();
                let keys = if i % 2 == 0 { vec!["go", "counter"] } else { vec!["go"] };
                let start = Instant::now();
                c.wait(&keys, DEADLINE).expect("woken before the deadline");
                start.elapsed()
            })
        })
        .collect();
    ready.wait();
    server.eventually("all waits are registered", |h| h.pending_waits() == n);
    let mut setter = server.client();
    setter.set("go", b"1").expect("set");
    server.eventually("odd waiters are released by the set", |h| h.pending_waits() == n / 2);
    setter.add("counter", 1).expect("add");
    for w in waiters {
        join(w);
    }
    assert_eq!(server.handle().pending_waits(), 0);
}

#[test]
fn store_wait_times_out_with_timeout_error_and_connection_stays_usable() {
    let server = TestServer::start();
    let mut c = server.client();
    let start = Instant::now();
    let err = c.wait(&["never"], Duration::from_millis(150)).expect_err("times out");
    let took = start.elapsed();
    assert!(err.is_timeout(), "{err}");
    assert!(took >= Duration::from_millis(150) && took < Duration::from_secs(3), "{took:?}");
    assert_eq!(server.handle().pending_waits(), 0, "cancel-wait removed the waiter");
    c.set("after", b"ok").expect("set after timeout");
    assert_eq!(c.get("after").expect("get after timeout"), b"ok");
}

#[test]
fn store_get_times_out_on_missing_key_with_client_timeout() {
    let server = TestServer::start();
    let mut c = StoreClient::connect(&server.addr, Duration::from_millis(200)).expect("connect");
    let err = c.get("missing").expect_err("times out");
    assert!(matches!(&err, StoreError::Timeout { op: "get", key, .. } if key == "missing"), "{err}");
}

#[test]
fn store_cancel_after_release_answers_stop_waiting_then_wait_canceled() {
    let server = TestServer::start();
    let mut raw = server.raw();
    raw.write_all(&encode(Request::Wait { keys: vec![b"/race".to_vec()] })).expect("wait");
    server.eventually("wait registered", |h| h.pending_waits() == 1);
    server.client().set("race", b"1").expect("set");
    server.eventually("wait released", |h| h.pending_waits() == 0);
    raw.write_all(&encode(Request::CancelWait)).expect("cancel");
    let mut reply = [0u8; 2];
    raw.read_exact(&mut reply).expect("two status bytes");
    assert_eq!(reply, [0, 1], "STOP_WAITING then WAIT_CANCELED");
}

#[test]
fn store_barrier_releases_all_participants_together() {
    let server = TestServer::start();
    let n = 4;
    let parties: Vec<_> = (0..n)
        .map(|_| {
            let mut c = server.client();
            spawn_with_deadline(move || c.barrier("step", n as i64, DEADLINE).expect("barrier"))
        })
        .collect();
    for p in parties {
        join(p);
    }
    let err = server.client().barrier("lonely", 2, Duration::from_millis(100)).expect_err("alone");
    assert!(err.is_timeout(), "{err}");
}

#[test]
fn store_blocking_queue_pop_is_fed_by_a_push_from_another_client() {
    let server = TestServer::start();
    let mut popper = server.client();
    let pop = spawn_with_deadline(move || popper.queue_pop("jobs", true).expect("pop"));
    server.eventually("pop is waiting", |h| h.pending_waits() == 1);
    server.client().queue_push("jobs", b"job-1").expect("push");
    assert_eq!(join(pop), Some(b"job-1".to_vec()));
}

#[test]
fn store_many_clients_adding_concurrently_lose_no_increment() {
    let server = TestServer::start();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let mut c = server.client();
            spawn_with_deadline(move || {
                for _ in 0..200 {
                    c.add("total", 1).expect("add");
                }
            })
        })
        .collect();
    for w in workers {
        join(w);
    }
    assert_eq!(server.client().add("total", 0).expect("read"), 1600);
}

#[test]
fn store_connect_retries_until_the_server_appears() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let addr = format!("127.0.0.1:{port}");
    let connecting = {
        let addr = addr.clone();
        spawn_with_deadline(move || StoreClient::connect(&addr, Duration::from_secs(5)))
    };
    thread::sleep(Duration::from_millis(300));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let handle = rt.block_on(StoreServer::start(addr.parse().expect("addr"))).expect("bind the same port");
    let mut client = join(connecting).expect("connected after retrying");
    client.set("x", b"y").expect("usable");
    rt.block_on(handle.shutdown()).expect("clean shutdown");
}

#[test]
fn store_connect_gives_up_with_connect_error_after_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let start = Instant::now();
    let err =
        StoreClient::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(300)).err().expect("nothing listens");
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

#[test]
fn store_prefix_store_namespaces_keys_like_torch() {
    let server = TestServer::start();
    let mut p = PrefixStore::new("default_pg", server.client());
    p.set("rank0", b"addr").expect("set");
    assert_eq!(server.client().get("default_pg/rank0").expect("visible unprefixed"), b"addr");
    assert_eq!(p.add("ctr", 2).expect("add"), 2);
    assert!(p.check(&["rank0", "ctr"]).expect("check"));
}

// ---- bad input ----------------------------------------------------------------------------

/// Sets a value through a well-behaved client, runs `abuse` on a raw socket, then checks the
/// server still serves a fresh client and the value survived.
fn survives(abuse: impl FnOnce(&TestServer)) {
    let server =
        TestServer::start_with(ServerConfig { stall_timeout: Duration::from_millis(300), ..ServerConfig::default() });
    let mut good = server.client();
    good.set("precious", b"keep me").expect("set");
    // A set has no answer: read it back, so the abuse on other connections comes after it.
    assert_eq!(good.get("precious").expect("get"), b"keep me");
    abuse(&server);
    assert_eq!(good.get("precious").expect("old client still served"), b"keep me");
    let mut fresh = server.client();
    assert_eq!(fresh.get("precious").expect("new client served"), b"keep me");
    fresh.set("after", b"1").expect("writes still work");
}

#[test]
fn store_garbage_after_validation_closes_only_that_connection() {
    survives(|server| {
        let mut raw = server.raw();
        raw.write_all(&[0xff, 0x13, 0x37, 0x00]).expect("garbage");
        assert_closed_by_server(&mut raw);
    });
}

#[test]
fn store_unknown_query_type_closes_the_connection() {
    survives(|server| {
        let mut raw = server.raw();
        raw.write_all(&[19]).expect("query 19 does not exist");
        assert_closed_by_server(&mut raw);
    });
}

#[test]
fn store_client_that_skips_validation_is_refused() {
    survives(|server| {
        let mut raw = TcpStream::connect(&server.addr).expect("connect");
        raw.set_read_timeout(Some(DEADLINE)).expect("timeout");
        raw.write_all(&encode(Request::Get { key: b"/precious".to_vec() })).expect("get");
        assert_closed_by_server(&mut raw);
    });
}

#[test]
fn store_wrong_magic_number_is_refused() {
    survives(|server| {
        let mut raw = TcpStream::connect(&server.addr).expect("connect");
        raw.set_read_timeout(Some(DEADLINE)).expect("timeout");
        raw.write_all(&encode(Request::Validate { magic: 0xdead_beef })).expect("bad magic");
        assert_closed_by_server(&mut raw);
    });
}

#[test]
fn store_absurd_key_and_value_lengths_are_refused_without_allocating() {
    survives(|server| {
        for frame in [
            [&[query::GET][..], &u64::MAX.to_le_bytes()].concat(),
            [&[query::SET][..], &2u64.to_le_bytes(), b"/k", &(1u64 << 62).to_le_bytes()].concat(),
            [&[query::WAIT][..], &(1u64 << 50).to_le_bytes()].concat(),
            [&[query::MULTI_SET][..], &u64::MAX.to_le_bytes()].concat(),
        ] {
            let mut raw = server.raw();
            raw.write_all(&frame).expect("absurd length");
            assert_closed_by_server(&mut raw);
        }
    });
}

#[test]
fn store_half_frame_then_close_applies_nothing() {
    survives(|server| {
        let mut raw = server.raw();
        let frame = encode(Request::Set { key: b"/half".to_vec(), value: vec![7; 1000] });
        raw.write_all(&frame[..frame.len() / 2]).expect("half a frame");
        drop(raw);
        let mut c = server.client();
        thread::sleep(Duration::from_millis(50));
        assert!(!c.check(&["half"]).expect("check"), "a half frame must not be applied");
    });
}

#[test]
fn store_client_stalling_mid_frame_is_disconnected_after_the_stall_timeout() {
    survives(|server| {
        let mut raw = server.raw();
        let frame = encode(Request::Set { key: b"/stall".to_vec(), value: vec![1; 100] });
        raw.write_all(&frame[..20]).expect("part of a frame");
        let start = Instant::now();
        assert_closed_by_server(&mut raw);
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(5), "{took:?}");
    });
}

#[test]
fn store_idle_client_between_frames_is_not_disconnected() {
    let server =
        TestServer::start_with(ServerConfig { stall_timeout: Duration::from_millis(100), ..ServerConfig::default() });
    let mut c = server.client();
    thread::sleep(Duration::from_millis(400));
    c.set("still", b"here").expect("idle connection still open");
    c.wait(&["never"], Duration::from_millis(300)).expect_err("a long wait is not a stall");
    c.ping().expect("still usable");
}

#[test]
fn store_waiters_of_a_vanished_client_are_cleaned_up() {
    survives(|server| {
        let mut raw = server.raw();
        raw.write_all(&encode(Request::Wait { keys: vec![b"/ghost".to_vec()] })).expect("wait");
        raw.write_all(&encode(Request::Barrier { key: b"/gb".to_vec(), world_size: 9 })).expect("barrier");
        server.eventually("both waits registered", |h| h.pending_waits() == 2);
        drop(raw);
        server.eventually("waits of the vanished client removed", |h| h.pending_waits() == 0);
        server.eventually("connection unregistered", |h| h.connections() == 1);
        server.client().set("ghost", b"nobody listens").expect("set wakes nobody");
    });
}

#[test]
fn store_add_to_non_integer_closes_the_connection_and_keeps_the_value() {
    survives(|server| {
        let mut c = server.client();
        let err = c.add("precious", 1).expect_err("not an integer");
        assert!(matches!(err, StoreError::Io { .. }), "{err}");
        assert!(matches!(c.ping(), Err(StoreError::Broken { .. })));
    });
}

#[test]
fn store_too_large_key_is_rejected_by_the_client_before_sending() {
    let server = TestServer::start();
    let mut c = server.client();
    let key = "k".repeat(64 * 1024);
    assert!(matches!(c.set(&key, b"v"), Err(StoreError::TooLarge { what: "key", .. })));
    c.ping().expect("connection untouched");
}

#[test]
fn store_hundred_concurrent_waiters_on_one_key_are_all_released_by_one_set() {
    let server = TestServer::start();
    let n = 100;
    let waiters: Vec<_> = (0..n)
        .map(|_| {
            let mut c = server.client();
            spawn_with_deadline(move || c.get("broadcast").expect("released"))
        })
        .collect();
    server.eventually("all waiting", |h| h.pending_waits() == n);
    server.client().set("broadcast", b"all").expect("set");
    for w in waiters {
        assert_eq!(join(w), b"all");
    }
    server.eventually("finished clients are unregistered", |h| h.connections() == 0);
}

#[test]
fn store_serve_on_injected_listener_stops_when_shutdown_resolves() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let addr = listener.local_addr().expect("local addr").to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = rt.spawn(StoreServer::serve(listener, async move {
        let _ = stopped.await;
    }));
    let mut c = StoreClient::connect(&addr, DEADLINE).expect("connect");
    c.set("k", b"v").expect("served");
    stop.send(()).expect("server is listening for shutdown");
    rt.block_on(async { tokio::time::timeout(DEADLINE, serving).await })
        .expect("serve returns before the deadline")
        .expect("serve task did not panic")
        .expect("serve returns Ok");
    assert!(c.ping().is_err(), "connections are closed on shutdown");
}

#[test]
fn store_dropping_the_handle_stops_the_server() {
    let server = TestServer::start();
    let mut c = server.client();
    c.ping().expect("served");
    let mut server = server;
    drop(server.handle.take());
    let start = Instant::now();
    while c.ping().is_ok() {
        assert!(start.elapsed() < DEADLINE, "server still serving after its handle was dropped");
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn store_dedicated_server_runs_on_its_own_thread_without_a_caller_runtime() {
    let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
    let handle = StoreServer::start_dedicated(any, ServerConfig::default()).expect("starts");
    let addr = handle.local_addr().to_string();
    let mut a = StoreClient::connect(&addr, DEADLINE).expect("connect");
    let mut b = StoreClient::connect(&addr, DEADLINE).expect("connect");
    let waiter = spawn_with_deadline(move || b.get("k").expect("released"));
    a.set("k", b"v").expect("set");
    assert_eq!(join(waiter), b"v");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async { tokio::time::timeout(DEADLINE, handle.shutdown()).await })
        .expect("shuts down before the deadline")
        .expect("clean shutdown");
    assert!(a.ping().is_err(), "connections closed");
}

#[test]
fn store_client_piling_up_waits_beyond_the_limit_is_disconnected() {
    let server = TestServer::start_with(ServerConfig { max_pending_waits: 2, ..ServerConfig::default() });
    let mut raw = server.raw();
    for key in ["/w1", "/w2", "/w3"] {
        raw.write_all(&encode(Request::Wait { keys: vec![key.as_bytes().to_vec()] })).expect("wait");
    }
    assert_closed_by_server(&mut raw);
    server.eventually("its waits are removed", |h| h.pending_waits() == 0);
    server.client().ping().expect("others still served");
}

#[test]
fn a_store_flooded_past_its_cap_closes_the_flooding_client_and_keeps_every_key() {
    let server = TestServer::start_with(ServerConfig { max_total_bytes: 1 << 20, ..ServerConfig::default() });
    let mut keeper = server.client();
    keeper.set("/keep", b"value").expect("set under the cap");
    let mut flood = server.client();
    let chunk = vec![b'x'; 200 * 1024];
    let mut appended = 0;
    let refused = loop {
        // APPEND has no reply: a ping tells whether the server took it or hung up.
        match flood.append("/flood", &chunk).and_then(|()| flood.ping()) {
            Ok(()) => appended += 1,
            Err(e) => break e,
        }
        assert!(appended < 10, "a 1 MiB store took {appended} appends of 200 KiB");
    };
    assert_eq!(appended, 5, "writes succeed up to the cap: {refused}");
    // The store and its keys are intact; writes that do not grow it still work.
    assert_eq!(keeper.get("/keep").expect("get"), b"value");
    keeper.set("/keep", b"other").expect("an overwrite of the same size");
    assert_eq!(server.client().get("/flood").expect("the flood's accepted part").len(), 5 * chunk.len());
    let grown = keeper.set("/new", &vec![0u8; 200 * 1024]).and_then(|()| keeper.ping());
    assert!(grown.is_err(), "growth past the cap fails for everyone");
    let mut after = server.client();
    assert!(after.delete_key("/flood").expect("delete"));
    after.set("/new", &vec![0u8; 200 * 1024]).expect("room again once keys are deleted");
}

#[tokio::test]
async fn probes_reach_a_live_endpoint_over_tcp_and_udp_and_miss_a_dead_or_frozen_one() {
    use std::time::Duration;
    let store = StoreServer::start("127.0.0.1:0".parse().unwrap()).await.expect("a store");
    let addr = store.local_addr();
    let udp = tokio::net::UdpSocket::bind(addr).await.expect("udp on the store's port");
    let echo = tokio::spawn(super::serve_udp_probes(udp));
    let a = addr.to_string();
    super::probe(&a, 7, Duration::from_secs(2)).await.expect("the store answers a ping");
    super::probe_udp(&a, 8, Duration::from_millis(20), Duration::from_secs(2)).await.expect("the echo answers");
    echo.abort();
    // Nothing there: refused at once (TCP reset, ICMP port unreachable), well before the timeout.
    store.shutdown().await.expect("store stops");
    let _ = echo.await;
    let t = std::time::Instant::now();
    assert!(super::probe(&a, 9, Duration::from_secs(5)).await.is_err());
    assert!(super::probe_udp(&a, 10, Duration::from_millis(20), Duration::from_secs(5)).await.is_err());
    assert!(t.elapsed() < Duration::from_secs(2), "refusals are quick: {:?}", t.elapsed());
    // A socket that never answers (a frozen agent): a miss at the timeout.
    let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.expect("udp");
    let s = silent.local_addr().unwrap().to_string();
    let err = super::probe_udp(&s, 11, Duration::from_millis(20), Duration::from_millis(300)).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").expect("tcp");
    let f = frozen.local_addr().unwrap().to_string();
    let err = super::probe(&f, 12, Duration::from_millis(300)).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "accepted by the kernel, never answered");
}

// Idle connections (issue 26, item 3): a connection that never validates cannot hold the server.

fn idle_config() -> ServerConfig {
    ServerConfig { first_frame_timeout: Duration::from_millis(300), ..ServerConfig::default() }
}

#[test]
fn store_connection_that_never_sends_a_frame_is_closed_after_the_first_frame_timeout() {
    let server = TestServer::start_with(idle_config());
    let mut idle = TcpStream::connect(&server.addr).expect("connect");
    idle.set_read_timeout(Some(DEADLINE)).expect("read timeout");
    let start = Instant::now();
    assert_closed_by_server(&mut idle);
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(5), "{took:?}");
    server.eventually("the idle connection is gone", |h| h.connections() == 0);
}

#[test]
fn store_validated_client_may_idle_and_wait_long_past_the_first_frame_timeout() {
    let server = TestServer::start_with(idle_config());
    let mut c = server.client();
    thread::sleep(Duration::from_millis(600));
    c.set("still", b"here").expect("an idle validated client is kept");
    c.wait(&["never"], Duration::from_millis(700)).expect_err("a wait longer than the timeout times out itself");
    assert_eq!(c.get("still").expect("still usable"), b"here");
}

#[test]
fn store_idle_connections_past_the_cap_evict_the_oldest_unvalidated_and_clients_get_in() {
    let server = TestServer::start_with(ServerConfig {
        max_unvalidated: 8,
        max_connections: 16,
        first_frame_timeout: Duration::from_secs(60),
        ..ServerConfig::default()
    });
    let mut kept = server.client();
    kept.set("k", b"v").expect("set");
    let mut idle: Vec<TcpStream> = (0..100)
        .map(|_| {
            let s = TcpStream::connect(&server.addr).expect("connect");
            s.set_read_timeout(Some(DEADLINE)).expect("read timeout");
            s
        })
        .collect();
    // Every one of them is accepted, so the listener's queue never holds a real client back.
    server.eventually("the server keeps at most 8 unvalidated", |h| h.connections() <= 9);
    let mut fresh = server.client();
    assert_eq!(fresh.get("k").expect("a new client gets in"), b"v");
    assert_eq!(kept.get("k").expect("a validated client is never evicted"), b"v");
    assert_closed_by_server(&mut idle[0]);
    // Validated clients fill the server (evicting the unvalidated on the way); once there is
    // no unvalidated connection left a new one is refused, and the validated stay served.
    let mut clients: Vec<StoreClient> = (0..13).map(|_| server.client()).collect();
    drop(idle);
    server.eventually("15 validated clients", |h| h.connections() == 15);
    clients.push(server.client());
    server.eventually("16 validated clients", |h| h.connections() == 16);
    let mut refused = TcpStream::connect(&server.addr).expect("the kernel completes the handshake");
    refused.set_read_timeout(Some(DEADLINE)).expect("read timeout");
    let mut twice = TcpStream::connect(&server.addr).expect("connect");
    twice.set_read_timeout(Some(DEADLINE)).expect("read timeout");
    assert_closed_by_server(&mut refused);
    assert_closed_by_server(&mut twice);
    for c in &mut clients {
        c.ping().expect("validated clients stay served");
    }
    kept.ping().expect("still served");
}

#[test]
fn admission_prefers_a_new_connection_to_the_oldest_unvalidated_and_never_evicts_validated() {
    assert_eq!(admit(0, 0, 16, 8), Admission::Admit);
    assert_eq!(admit(8, 7, 16, 8), Admission::Admit);
    assert_eq!(admit(8, 8, 16, 8), Admission::AdmitEvictingOldest);
    assert_eq!(admit(16, 1, 16, 8), Admission::AdmitEvictingOldest);
    assert_eq!(admit(16, 0, 16, 8), Admission::Refuse);
    assert_eq!(admit(20, 0, 16, 8), Admission::Refuse);
    let derived = default_max_connections();
    assert!((16..=MAX_CONNECTIONS_CEILING).contains(&derived), "{derived}");
}
