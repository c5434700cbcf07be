//! The status page of `rlaunch-rendezvous` (`/`) in a real headless Chromium, driven over the
//! DevTools protocol ([`integration_tests::browser`]): without the token it shows no job and asks
//! for one; with it, it follows a 2-node job live — formed, a node lost (every process of its
//! network-namespace host killed), re-formed on the survivor, finished — reading the page's DOM
//! all along, never reloading it. Screenshots are kept in `target/<profile>/status-page/`.
//!
//! Needs root (network namespaces), the built binaries and Debian's `chromium`
//! (`scripts/install-deps.sh`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use integration_tests::browser::Browser;
use integration_tests::netns::{self, finish, listening, loop_worker, Cluster, Proc};
use integration_tests::{bin, target_dir, tempdir, wait_until};
use serde_json::Value;

const NPROC: u32 = 2;
/// A dead node is suspected at its TTL (it has sent too few heartbeats for an earlier verdict)
/// and lost when the probes of it time out 4 s later: the page, which re-reads the job every
/// 2 s, must show it suspected in between. Peer watching is off: its verdict on a killed host
/// comes within a ping, before any suspicion the page could show.
const CONF: &str =
    "heartbeat_interval=0.5,node_ttl=5,probe_timeout=4,last_call_timeout=1,join_timeout=30,peer_interval=0";
const FORM: Duration = Duration::from_secs(30);
/// How long the page may take to show what the service already knows (one watch answer, or
/// the 2 s re-read, plus rendering).
const PAGE: Duration = Duration::from_secs(10);

/// What the page shows of its selected job, read from its DOM.
const JOB_VIEW: &str = r#"(() => {
  const box = document.getElementById('job');
  const rows = [...document.querySelectorAll('#members tbody tr[data-node]')];
  return {
    shown: !box.hidden && !document.getElementById('job-body').hidden,
    state: box.dataset.state || null,
    round: box.dataset.round ? Number(box.dataset.round) : null,
    world: box.dataset.worldSize ? Number(box.dataset.worldSize) : null,
    members: rows.map((r) => r.dataset.node),
    beats: rows.map((r) => r.children[3].textContent),
    suspected: rows.filter((r) => r.children[4].classList.contains('suspected')).map((r) => r.dataset.node),
    listed: [...document.querySelectorAll('#job-table tbody tr[data-job]')].map((r) => r.dataset.job),
    conn: document.getElementById('conn').dataset.state,
  };
})()"#;

/// The recovery as the service accounts it, against the test's own clock (one machine): host b
/// killed at `killed_ms`, host a's new workers writing their start lines (`again`); then the
/// same on the page (its table and timeline) and in `/metrics`.
fn check_recovery(browser: &mut Browser, token: &str, lost: &str, killed_ms: u64, again: &[netns::Start]) {
    let fetch = |path: &str, how: &str| {
        format!("fetch('{path}', {{headers: {{Authorization: 'Bearer ' + {token:?}}}}}).then((r) => r.{how}())")
    };
    let status = browser.eval(&fetch("/v1/jobs/page", "json"));
    let rec = &status["recovery"];
    eprintln!("recovery: {rec}");
    // The last recovery (a first round that formed on host a alone would add a scale-up before).
    let r = rec["recoveries"].as_array().and_then(|l| l.last()).expect("a recovery");
    let ms = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("a number of ms: {v} in {r}"));
    assert_eq!(r["kind"], "node_lost", "{rec}");
    assert!(r["fault"].as_str().is_some_and(|f| f.contains(lost)), "the fault names the lost node: {r}");
    // The fault is dated at b's last heartbeat: before the kill, within one interval (0.5 s)
    // and the time a heartbeat takes.
    let (fault, noticed, reformed) = (ms(&r["fault_at"]), ms(&r["noticed_at"]), ms(&r["reformed_at"]));
    assert!(fault <= killed_ms + 50 && fault + 1000 >= killed_ms, "fault at {fault}, killed at {killed_ms}");
    assert!(killed_ms <= noticed && noticed <= reformed, "killed {killed_ms}, noticed {noticed}, re-formed {reformed}");
    let p = &r["phases"];
    assert_eq!((ms(&p["noticing_ms"]), ms(&p["reforming_ms"])), (noticed - fault, reformed - noticed), "{r}");
    // Host a's workers started (dated by its agent's report) when they wrote their start lines.
    let started = reformed + ms(&p["starting_ms"]);
    let wrote = again.iter().map(|s| (s.t * 1000.0) as u64).max().expect("a start");
    assert!(started <= wrote + 200 && started + 1000 >= wrote, "started at {started}, the workers wrote at {wrote}");
    // No snapshots: nothing restored, the recovery ended when the workers started.
    assert!(p["restoring_ms"].is_null() && p["steps_redone"].is_null(), "{r}");
    assert_eq!((r["ongoing"].as_bool(), ms(&r["lost_ms"])), (Some(false), started - fault), "{r}");
    let goodput = rec["goodput"].as_f64().expect("a goodput");
    assert!(goodput > 0.0 && goodput < 1.0, "{goodput}");

    let round = ms(&r["round"]);
    let view = r#"(() => {
          const row = document.querySelector('#recoveries tbody tr[data-round="ROUND"]');
          const cell = (p) => row && row.querySelector('td[data-phase="' + p + '"]');
          // Shown once host a's report of its workers' start was read (the page re-reads the
          // job every 2 s: a report bumps no round, so no watch answers it).
          if (!row || !cell('starting').dataset.ms) return null;
          return {
            noticing: Number(cell('noticing').dataset.ms),
            starting: cell('starting').textContent,
            restoring: cell('restoring').textContent,
            kept: cell('ranks_kept').textContent,
            fault: row.children[1].textContent,
            goodput: document.getElementById('goodput').textContent,
            phases: [...document.querySelectorAll('#timeline rect[data-phase][data-round="ROUND"]')].map((e) => e.dataset.phase),
            lost: [...document.querySelectorAll('#timeline circle[data-mark="lost"]')].map((e) => e.dataset.node),
            lanes: [...new Set([...document.querySelectorAll('#timeline rect[data-node]')].map((e) => e.dataset.node))],
          };
        })()"#;
    let shown = browser.wait_for("the recovery on the page", &view.replace("ROUND", &round.to_string()), PAGE);
    eprintln!("on the page: {shown}");
    assert_eq!(shown["noticing"].as_u64(), Some(ms(&p["noticing_ms"])));
    assert!(shown["starting"].as_str().is_some_and(|s| s.ends_with(" s")), "{shown}");
    assert_eq!(shown["restoring"], "—", "not known, never guessed");
    // Host a's workers were started again, not kept (no rlaunch.resilient).
    assert_eq!(shown["kept"], "0", "{shown}");
    assert!(shown["fault"].as_str().is_some_and(|f| f.contains(lost)), "{shown}");
    assert!(shown["goodput"].as_str().is_some_and(|g| g.contains("goodput") && g.contains("recover")), "{shown}");
    assert_eq!(shown["phases"], serde_json::json!(["noticing", "reforming", "starting"]), "{shown}");
    assert_eq!(shown["lost"], serde_json::json!([lost]), "{shown}");
    assert_eq!(shown["lanes"].as_array().map(Vec::len), Some(2), "a lane per node: {shown}");

    let metrics = browser.eval(&fetch("/metrics", "text"));
    let metrics = metrics.as_str().unwrap_or_default();
    for line in [
        "rlaunch_job_last_recovery_ranks_kept{run_id=\"page\"} 0",
        "rlaunch_job_goodput{run_id=\"page\"} ",
        "rlaunch_job_recoveries_total{run_id=\"page\"} ",
        "rlaunch_job_last_recovery_seconds{run_id=\"page\",phase=\"noticing\"} ",
    ] {
        assert!(metrics.contains(line), "/metrics has {line}:\n{metrics}");
    }
}

fn screenshot(browser: &mut Browser, name: &str) {
    let dir = target_dir().join("status-page");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    let path = dir.join(name);
    browser.screenshot(&path);
    eprintln!("screenshot: {}", path.display());
}

fn agent_args(endpoint: &str, token_file: &Path, dir: &Path) -> Vec<String> {
    let mut a: Vec<String> = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        &NPROC.to_string(),
        "--rdzv-backend",
        "rlaunch",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "page",
        "--rdzv-conf",
        CONF,
        "--shutdown-timeout",
        "6",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push("--rdzv-token-file".into());
    a.push(token_file.display().to_string());
    a.push(loop_worker(dir).display().to_string());
    a.push(dir.display().to_string());
    a
}

#[test]
fn the_page_follows_a_job_that_forms_loses_a_node_and_reforms() {
    let cluster = Cluster::new(2);
    let dir = tempdir();
    // As `openssl rand -base64` makes them: `+`, `/` and `=` reach the service as written.
    let token = format!("page+token/{}==", std::process::id());
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, &token).expect("token file");
    let listen = format!("{}:{}", cluster.root_ip(), cluster.free_root_port());
    let mut service = Command::new(bin("rlaunch-rendezvous"));
    service
        .args(["--listen", &listen, "--store", "memory", "--token-file"])
        .arg(&token_file)
        .env("RLAUNCH_LOG", "info");
    let _service = Proc::spawn(service, "rlaunch-rendezvous", &dir.path().join("service.log"));
    wait_until("the service to listen", Duration::from_secs(10), || listening(&listen));

    let mut browser = Browser::launch(&dir.path().join("chromium.log"));

    // Without the token the page asks for it and shows nothing of any job.
    browser.open(&format!("http://{listen}/"));
    browser.wait_for("the token form", "!document.getElementById('auth').hidden", PAGE);
    assert_eq!(browser.eval("document.getElementById('content').hidden"), Value::Bool(true));
    assert_eq!(browser.eval("document.getElementById('conn').dataset.state"), "unauthorized");

    // With it (in the fragment: never sent to the server, and taken out of the address bar),
    // opened before the job exists.
    browser.open(&format!("http://{listen}/#token={token}&job=page"));
    browser.wait_for("that the job is not there yet", "!document.getElementById('job-missing').hidden", PAGE);
    let hash = browser.eval("location.hash");
    assert_eq!(hash, "#job=page", "the token left the address bar");

    let args = agent_args(&listen, &token_file, dir.path());
    let mut agents: Vec<Proc> = cluster.hosts().iter().map(|h| h.rlaunch(dir.path(), &args)).collect();
    netns::wait_formed(dir.path(), &["a", "b"], NPROC, &mut agents, FORM);
    let formed = browser.wait_for(
        "the 2-node round",
        &format!("(v => v.state === 'running' && v.members.length === 2 && v.world === 4 && v)({JOB_VIEW})"),
        PAGE,
    );
    eprintln!("formed: {formed}");
    assert_eq!(formed["listed"], serde_json::json!(["page"]));
    assert_eq!(formed["conn"], "live");
    let round = formed["round"].as_u64().expect("a round");
    // Heartbeat ages are shown and recent.
    for beat in formed["beats"].as_array().expect("beats") {
        let s = beat.as_str().unwrap_or_default();
        assert!(s.ends_with(" s ago"), "heartbeat cell {s:?}");
    }
    screenshot(&mut browser, "formed.png");

    // Host b is lost: every process of it killed at once.
    let b_nodes: Vec<String> = formed["members"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(Value::as_str)
        .filter(|n| n.starts_with('b'))
        .map(str::to_owned)
        .collect();
    assert_eq!(b_nodes.len(), 1, "one member is host b's: {formed}");
    let killed_ms = (netns::now_unix_f64() * 1000.0) as u64;
    cluster.host(1).kill_all();
    // Before the job drops it, the page shows host b's node as suspected (its heartbeats stopped).
    let suspected = browser.wait_for(
        "host b's node suspected",
        &format!("(v => v.suspected.includes({:?}) && v)({JOB_VIEW})", b_nodes[0]),
        PAGE,
    );
    eprintln!("suspected: {suspected}");
    assert_eq!(suspected["round"].as_u64(), Some(round), "still the round host b was lost from");
    screenshot(&mut browser, "suspected.png");
    let again = netns::wait_formed(dir.path(), &["a"], NPROC, &mut agents[..1], FORM);
    let reformed = browser.wait_for(
        "the re-formed round on host a alone",
        &format!(
            "(v => v.state === 'running' && v.round > {round} && v.members.length === 1 && v.world === 2 && v)({JOB_VIEW})"
        ),
        PAGE,
    );
    eprintln!("re-formed: {reformed}");
    assert!(!reformed["members"][0].as_str().unwrap_or_default().starts_with('b'), "host b is gone: {reformed}");
    let event = browser.eval("document.querySelector('[data-fact=\"last event\"]').textContent");
    eprintln!("last event: {event}");
    let closed = format!("round {} closed", reformed["round"]);
    assert!(event.as_str().is_some_and(|e| e.contains(&closed)), "the page says the round closed: {event}");
    check_recovery(&mut browser, &token, &b_nodes[0], killed_ms, &again);
    screenshot(&mut browser, "reformed.png");

    finish(dir.path(), &mut agents[..1]);
    browser.wait_for("the finished job", &format!("(v => v.state === 'finished' && v)({JOB_VIEW})"), PAGE);
    screenshot(&mut browser, "finished.png");
}

/// POSTs `body` to the service with the token (plain HTTP/1.1 on a socket); the answer's JSON.
fn post(listen: &str, token: &str, path: &str, body: &Value) -> Value {
    use std::io::{Read, Write};
    let body = body.to_string();
    let mut s = std::net::TcpStream::connect(listen).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {listen}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("answer");
    let (head, json) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}\n{json}");
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{path}: {e}: {json}"))
}

/// A free port on loopback, as `127.0.0.1:PORT`.
fn free_loopback() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    format!("127.0.0.1:{port}")
}

/// `rlaunch-rendezvous` (memory store) on `listen` with `token`, its output in `log`.
fn serve(listen: &str, token: &str, log: &Path) -> Proc {
    let mut service = Command::new(bin("rlaunch-rendezvous"));
    service.args(["--listen", listen, "--store", "memory", "--token", token]).env("RLAUNCH_LOG", "info");
    let p = Proc::spawn(service, "rlaunch-rendezvous", log);
    wait_until("the service to listen", Duration::from_secs(10), || listening(listen));
    p
}

/// Node `node_id` joins `job`, a job of one node that closes its round at once and whose slow
/// timers let nothing lapse during a test; the node's secret.
fn join_one_node_job(listen: &str, token: &str, job: &str, node_id: &str) -> String {
    let settings = serde_json::json!({
        "min_nodes": 1, "max_nodes": 1, "join_timeout_ms": 60000, "last_call_timeout_ms": 1000,
        "heartbeat_interval_ms": 10000, "node_ttl_ms": 50000, "probe_timeout_ms": 30000, "max_restarts": 0
    });
    let node = serde_json::json!({"node_id": node_id, "local_world_size": 1, "store_addr": "127.0.0.1:1"});
    let body = serde_json::json!({"settings": settings, "node": node});
    let joined = post(listen, token, &format!("/v1/jobs/{job}/join"), &body);
    joined["secret"].as_str().expect("a secret").to_owned()
}

#[test]
fn markup_in_node_ids_and_root_causes_is_shown_as_text_and_a_wrong_token_shows_nothing() {
    let dir = tempdir();
    let listen = free_loopback();
    let token = "page-markup-token";
    let _service = serve(&listen, token, &dir.path().join("service.log"));

    // A client of the service (any job's agent may be hostile) names its node and its failure
    // with markup that would run script if the page wrote it as HTML.
    let evil_node = r#"<img src=x onerror="document.title='pwned-node'">"#;
    let evil_message = r#"<script>document.title='pwned-script'</script><b id=injected>bold</b>"#;
    let secret = join_one_node_job(&listen, token, "markup", evil_node);
    let mut cause =
        serde_json::to_value(rlaunch::contract::RootCause::from_message(evil_message.to_owned())).expect("json");
    cause["traceback"] = Value::from(format!("Traceback: {evil_node}"));
    // Where the ranks stood (as a hang report has them): one line per group of ranks.
    cause["stacks"] = serde_json::json!(["rank 0: stuck_here (train.py:4) <- main (train.py:12)"]);
    post(
        &listen,
        token,
        "/v1/jobs/markup/failure",
        &serde_json::json!({"node_id": evil_node, "secret": secret, "round": 1, "root_cause": cause}),
    );

    let mut browser = Browser::launch(&dir.path().join("chromium.log"));
    // A wrong token: refused, nothing shown.
    browser.open(&format!("http://{listen}/#token=wrong&job=markup"));
    browser.wait_for("the token refused", "!document.getElementById('auth-error').hidden", PAGE);
    assert_eq!(browser.eval("document.getElementById('content').hidden"), Value::Bool(true));
    assert_eq!(
        browser.eval("document.body.innerText.includes('pwned') || document.body.innerText.includes('markup')"),
        Value::Bool(false)
    );

    // The right one, typed into the form.
    browser.eval(&format!(
        "document.getElementById('auth-token').value = {token:?}; document.getElementById('auth-form').requestSubmit(); true"
    ));
    let shown = browser.wait_for(
        "the failed job with its root cause",
        "(() => { const c = document.getElementById('cause'); return !document.getElementById('cause-box').hidden && c.textContent; })()",
        PAGE,
    );
    let shown = shown.as_str().unwrap_or_default();
    assert!(shown.contains(evil_message), "the message is shown as written: {shown}");
    assert!(shown.contains(evil_node), "the traceback is shown as written: {shown}");
    let stacks = browser.eval("[...document.querySelectorAll('#stacks li')].map((li) => li.textContent)");
    assert_eq!(
        stacks,
        serde_json::json!(["rank 0: stuck_here (train.py:4) <- main (train.py:12)"]),
        "the stacks are listed"
    );
    let row = browser.eval("document.querySelector('#members tbody tr td').textContent");
    assert_eq!(row, evil_node, "the node id is shown as written");
    // Nothing of it became markup, and no script of it ran.
    assert_eq!(browser.eval("document.querySelectorAll('img, #injected, body script:not([src])').length"), 0);
    assert_eq!(browser.eval("document.title"), "rlaunch rendezvous");
    assert_eq!(browser.eval("document.getElementById('job').dataset.state"), "failed");
    screenshot(&mut browser, "markup.png");
}

#[test]
fn switching_between_jobs_keeps_one_watch_in_flight_and_a_service_restart_is_survived() {
    // Each selected job is followed by a long-poll that may hold a connection for 20 s; a
    // browser has 6 per host. Selecting jobs back and forth must end the old loops and abort
    // their requests, not stack them.
    let dir = tempdir();
    let listen = free_loopback();
    let token = "page-switch-token";
    // Running jobs of one node each.
    let create = |jobs: &[&str]| {
        for job in jobs {
            join_one_node_job(&listen, token, job, &format!("{job}-node"));
        }
    };
    let mut service = serve(&listen, token, &dir.path().join("service.log"));
    create(&["left", "right"]);

    let mut browser = Browser::launch(&dir.path().join("chromium.log"));
    browser.open(&format!("http://{listen}/#token={token}&job=left"));
    browser.wait_for("job left", "document.getElementById('job').dataset.state === 'running'", PAGE);
    // Count the page's watch requests in flight from here on.
    browser.eval(
        "window.watches = 0; const f = window.fetch; window.fetch = (...a) => { \
           if (!String(a[0]).endsWith('/watch')) return f(...a); \
           window.watches++; return f(...a).finally(() => window.watches--); }; true",
    );
    for job in ["right", "left", "right", "left", "right", "left"] {
        browser.eval(&format!("location.hash = '#job={job}'; true"));
        std::thread::sleep(Duration::from_millis(150));
    }
    browser.wait_for("job left again", "document.getElementById('job').dataset.job === 'left' && document.getElementById('job').dataset.state === 'running'", PAGE);
    std::thread::sleep(Duration::from_secs(2));
    let in_flight = browser.eval("window.watches");
    assert_eq!(in_flight, 1, "one watch request in flight after switching jobs six times");
    // And it is the selected job's.
    let list = browser.eval("[...document.querySelectorAll('#job-table tbody tr.selected')].map((r) => r.dataset.job)");
    assert_eq!(list, serde_json::json!(["left"]));

    // The service goes away: the page says so; back (a new process, its memory empty), the
    // page finds the job again once it exists, without a reload.
    service.kill();
    browser.wait_for("the service unreachable", "document.getElementById('conn').dataset.state === 'error'", PAGE);
    let _service = serve(&listen, token, &dir.path().join("service-again.log"));
    browser.wait_for("the job gone with the old process", "!document.getElementById('job-missing').hidden", PAGE);
    create(&["left"]);
    browser.wait_for(
        "the job again, live",
        "document.getElementById('job').dataset.state === 'running' && document.getElementById('conn').dataset.state === 'live'",
        PAGE,
    );
    assert!(browser.eval("window.watches").as_i64().is_some_and(|n| n <= 1), "still one watch at most");
}
