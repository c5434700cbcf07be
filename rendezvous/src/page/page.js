// The status page of rlaunch-rendezvous: jobs, their rounds and members, the last root cause.
// It reads the service's own API (GET /v1/jobs, GET /v1/jobs/{id}, POST /v1/jobs/{id}/watch)
// with the bearer token the user gives (URL fragment `#token=…` or the form; kept in
// sessionStorage, sent only to this origin in a header). The selected job is followed through
// one watch long-poll, so a new round shows at once; the list is re-read every few seconds.
// Nothing is read while the tab is hidden. Everything from the service is written with
// textContent: a node id or a stack line is never markup.
'use strict';

const LIST_EVERY_MS = 3000;
const JOB_EVERY_MS = 2000;
/// A finished or failed job changes no more: re-read it seldom, and watch it no longer.
const OVER_EVERY_MS = 15000;
const WATCH_WAIT_MS = 20000;
/// Between two watch requests at least this long, whatever they answer.
const WATCH_GAP_MS = 500;
const MAX_ROWS = 500;
const TOKEN_KEY = 'rlaunch-rendezvous-token';

const st = {
  token: sessionStorage.getItem(TOKEN_KEY),
  selected: null,
  jobs: [],
  job: null, // {status, at} of the selected job, or {missing: true}
  rendered: null, // the JSON of the job status last drawn
  follow: null, // {abort} of the one watch loop
  listTimer: null,
  jobTimer: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function sleep(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

const over = (status) => status && (status.state === 'finished' || status.state === 'failed');

class Unauthorized extends Error {}
class NotFound extends Error {}

async function api(path, body, signal) {
  const headers = { Accept: 'application/json' };
  if (st.token) headers.Authorization = 'Bearer ' + st.token;
  const init = { headers, cache: 'no-store', signal };
  if (body !== undefined) {
    init.method = 'POST';
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 401) throw new Unauthorized();
  if (r.status === 404) throw new NotFound();
  if (!r.ok) {
    let msg = r.status + ' ' + r.statusText;
    try { msg = (await r.json()).message || msg; } catch (_) { /* not JSON */ }
    throw new Error(msg);
  }
  return r.json();
}

// --- the URL fragment: #token=…&job=… -------------------------------------------------------

// Parsed by hand: a token is taken byte for byte (`+` stays `+`), percent-escapes decoded.
function fragment() {
  const out = new Map();
  for (const part of location.hash.slice(1).split('&')) {
    if (!part) continue;
    const at = part.indexOf('=');
    const key = at < 0 ? part : part.slice(0, at);
    let value = at < 0 ? '' : part.slice(at + 1);
    try { value = decodeURIComponent(value); } catch (_) { /* kept as written */ }
    out.set(key, value);
  }
  return out;
}

function setFragment(job) {
  const frag = job ? 'job=' + encodeURIComponent(job) : '';
  if (location.hash.slice(1) !== frag) history.replaceState(null, '', location.pathname + location.search + (frag ? '#' + frag : ''));
}

function readFragment() {
  const f = fragment();
  const token = (f.get('token') || '').trim();
  const job = f.has('job') ? f.get('job') : st.selected;
  if (token) {
    // Out of the address bar at once (the browser's history may still hold the address).
    setFragment(job);
    useToken(token);
  }
  select(job);
}

function useToken(token) {
  st.token = token;
  sessionStorage.setItem(TOKEN_KEY, token);
  refreshList();
  if (st.selected) {
    refreshJob();
    followJob(st.selected);
  }
}

function select(id) {
  id = id || null;
  if (id === st.selected) return;
  st.selected = id;
  st.job = null;
  st.rendered = null;
  setFragment(id);
  renderList();
  renderJob();
  if (id) {
    refreshJob();
    followJob(id);
  } else {
    stopFollowing();
  }
}

// --- connection state ---------------------------------------------------------------------

function setConn(state, text) {
  const c = $('conn');
  c.dataset.state = state;
  c.textContent = text;
  if (state === 'live') $('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
}

function showAuth(refused) {
  setConn('unauthorized', 'token needed');
  $('auth').hidden = false;
  $('content').hidden = true;
  $('auth-error').hidden = !refused;
}

function onError(e) {
  if (e instanceof Unauthorized) {
    showAuth(!!st.token);
    return true;
  }
  setConn('error', 'cannot reach the service: ' + e.message);
  return false;
}

// --- reading -------------------------------------------------------------------------------

async function refreshList() {
  clearTimeout(st.listTimer);
  st.listTimer = null;
  if (document.hidden) return; // resumed by visibilitychange
  try {
    st.jobs = await api('/v1/jobs');
    $('auth').hidden = true;
    $('content').hidden = false;
    setConn('live', 'live');
    if (!st.selected && st.jobs.length === 1) select(st.jobs[0].run_id);
    renderList();
  } catch (e) {
    if (onError(e)) return; // waits for a token: no timer
  } finally {
    // One chain only, whoever called.
    clearTimeout(st.listTimer);
  }
  st.listTimer = setTimeout(refreshList, LIST_EVERY_MS);
}

/// Re-reads the selected job; true when it was read.
async function refreshJob() {
  const id = st.selected;
  if (!id) return false;
  clearTimeout(st.jobTimer);
  st.jobTimer = null;
  if (document.hidden) return false;
  let read = false;
  try {
    const status = await api('/v1/jobs/' + encodeURIComponent(id));
    read = true;
    if (st.selected === id) {
      st.job = { status, at: Date.now() };
      // The list shows the same job as the detail, without waiting for its own re-read.
      const i = st.jobs.findIndex((j) => j.run_id === id);
      if (i >= 0) st.jobs[i] = status; else st.jobs.push(status);
      renderList();
      // A run id used again after its job ended: follow the new job.
      if (!over(status) && !st.follow) followJob(id);
    }
  } catch (e) {
    if (e instanceof NotFound) {
      if (st.selected === id) st.job = { missing: true };
    } else if (onError(e)) {
      return false;
    }
  } finally {
    if (st.selected === id) {
      try { renderJob(); } catch (e) { setConn('error', 'cannot show this job: ' + e.message); }
      clearTimeout(st.jobTimer);
      const every = st.job && over(st.job.status) ? OVER_EVERY_MS : JOB_EVERY_MS;
      st.jobTimer = setTimeout(refreshJob, every);
    }
  }
  return read;
}

function stopFollowing() {
  if (st.follow) st.follow.abort.abort();
  st.follow = null;
}

// Follows one job through the watch long-poll: each answer (a new round, the job's end, or
// nothing within the wait) re-reads it, so a re-formed round shows within one request. One
// loop at a time: selecting another job, or this one again, ends the previous loop and aborts
// its request.
async function followJob(id) {
  stopFollowing();
  const me = { abort: new AbortController() };
  st.follow = me;
  const mine = () => st.follow === me && st.selected === id;
  let after = st.job && st.job.status ? st.job.status.round : 0;
  while (mine()) {
    const started = Date.now();
    if (document.hidden) {
      await sleep(JOB_EVERY_MS);
      continue;
    }
    let ev = null;
    try {
      ev = await api('/v1/jobs/' + encodeURIComponent(id) + '/watch', { after_round: after, wait_ms: WATCH_WAIT_MS }, me.abort.signal);
    } catch (e) {
      if (!mine() || e instanceof Unauthorized) break;
      await sleep(JOB_EVERY_MS); // not there yet, or the service is away
      continue;
    }
    if (!mine()) break;
    if (ev.event === 'new_round' && typeof ev.data === 'number') after = Math.max(after, ev.data);
    const read = await refreshJob();
    if (st.job && st.job.status) after = Math.max(after, st.job.status.round);
    if (ev.event === 'finished' || ev.event === 'failed' || (st.job && over(st.job.status))) break; // over: refreshJob goes on, slowly
    await sleep(read ? Math.max(0, WATCH_GAP_MS - (Date.now() - started)) : JOB_EVERY_MS);
  }
  if (st.follow === me) st.follow = null;
}

// --- rendering ------------------------------------------------------------------------------

function briefCause(c) {
  if (!c) return '';
  const exit = c.exit && ('code' in c.exit ? 'exit ' + c.exit.code : 'signal ' + c.exit.signal);
  return 'rank ' + c.rank + ' on ' + c.host + ': ' + (c.message || exit || '');
}

let listDrawn = null;

function renderList() {
  const shown = st.jobs.slice(0, MAX_ROWS).map((j) => [j.run_id, j.state, j.round, j.members.length, j.pending.length, j.world_size, j.restart_count, j.max_restarts, briefCause(j.last_root_cause)]);
  const key = JSON.stringify([shown, st.jobs.length, st.selected]);
  if (key === listDrawn) return;
  listDrawn = key;
  const tbody = $('job-table').tBodies[0];
  tbody.replaceChildren();
  $('job-count').textContent = st.jobs.length ? '(' + st.jobs.length + ')' : '';
  $('no-jobs').hidden = st.jobs.length > 0;
  for (const j of st.jobs.slice(0, MAX_ROWS)) {
    const tr = el('tr');
    tr.dataset.job = j.run_id;
    tr.dataset.state = j.state;
    tr.dataset.round = j.round;
    if (j.run_id === st.selected) tr.className = 'selected';
    tr.append(
      el('td', j.run_id),
      el('td', j.state, 'state-' + j.state),
      el('td', j.round, 'num'),
      el('td', j.members.length + (j.pending.length ? ' (+' + j.pending.length + ' waiting)' : ''), 'num'),
      el('td', j.world_size, 'num'),
      el('td', j.restart_count + ' of ' + j.max_restarts, 'num'),
      el('td', briefCause(j.last_root_cause), 'cause-brief'),
    );
    tr.addEventListener('click', () => select(j.run_id));
    tbody.append(tr);
  }
  if (st.jobs.length > MAX_ROWS) {
    const tr = el('tr');
    const td = el('td', '… and ' + (st.jobs.length - MAX_ROWS) + ' more jobs (select one with #job=ID)');
    td.colSpan = 7;
    tr.append(td);
    tbody.append(tr);
  }
}

function age(ms) {
  if (ms === null || ms === undefined) return '—';
  return ms < 10000 ? (ms / 1000).toFixed(1) + ' s ago' : Math.round(ms / 1000) + ' s ago';
}

function health(h) {
  if (!h) return '';
  const parts = [];
  if (h.suspected_for_ms !== null && h.suspected_for_ms !== undefined) parts.push('suspected for ' + (h.suspected_for_ms / 1000).toFixed(1) + ' s');
  if (h.phi !== null && h.phi !== undefined) parts.push(h.phi > 999 ? 'phi > 999' : 'phi ' + h.phi.toFixed(1));
  if (h.heartbeat_loss) parts.push(Math.round(h.heartbeat_loss * 100) + ' % beats lost');
  if (h.missed_by && h.missed_by.length) parts.push('unreachable from ' + h.missed_by.join(', '));
  if (h.reached_by) parts.push('reached by ' + h.reached_by);
  return parts.join('; ');
}

function fact(dl, name, value) {
  if (value === null || value === undefined || value === '') return;
  const dt = el('dt', name);
  const dd = el('dd', value);
  dd.dataset.fact = name;
  dl.append(dt, dd);
}

// Whether `part` of the selected job differs from what was drawn last (then it is drawn
// again): a section is rebuilt only when its own data changed, so a text selection in the
// root cause survives new heartbeats.
function changed(part, value) {
  const key = JSON.stringify(value);
  if (st.rendered && st.rendered[part] === key) return false;
  st.rendered = st.rendered || {};
  st.rendered[part] = key;
  return true;
}

function renderJob() {
  const box = $('job');
  box.hidden = !st.selected;
  if (!st.selected) return;
  $('job-id').textContent = st.selected;
  const j = st.job && st.job.status;
  $('job-missing').hidden = !(st.job && st.job.missing);
  $('job-body').hidden = !j;
  box.dataset.job = st.selected;
  if (!j) {
    st.rendered = null;
    delete box.dataset.state;
    delete box.dataset.round;
    delete box.dataset.worldSize;
    return;
  }
  box.dataset.state = j.state;
  box.dataset.round = j.round;
  box.dataset.worldSize = j.world_size;

  const facts = [
    ['state', j.state],
    ['round', j.round],
    ['world size', j.world_size],
    ['nodes', j.settings.min_nodes === j.settings.max_nodes ? j.settings.min_nodes : j.settings.min_nodes + ' to ' + j.settings.max_nodes],
    ['restarts', j.restart_count + ' of ' + j.max_restarts],
    ['last event', j.last_reason],
    ['failure', j.failure],
    ['straggler', j.straggler && 'rank ' + j.straggler.rank + ' on ' + j.straggler.node_id + ', ' + Number(j.straggler.late_ms).toFixed(1) + ' ms late per step'],
    ['nodes differ', j.fingerprint_diff && j.fingerprint_diff.join('; ')],
  ];
  if (changed('facts', facts)) {
    const dl = $('job-facts');
    dl.replaceChildren();
    for (const [name, value] of facts) fact(dl, name, value);
  }

  const members = [...j.members].sort((a, b) => (a.group_rank ?? 0) - (b.group_rank ?? 0));
  const rows = members.slice(0, MAX_ROWS).map((m) => [m.node_id, m.group_rank, m.local_world_size, m.succeeded]);
  if (changed('members', [rows, members.length])) {
    $('member-count').textContent = '(' + members.length + ')';
    const tbody = $('members').tBodies[0];
    tbody.replaceChildren();
    for (const [node, rank, workers, succeeded] of rows) {
      const tr = el('tr');
      tr.dataset.node = node;
      tr.dataset.groupRank = rank;
      tr.append(el('td', node), el('td', rank, 'num'), el('td', workers, 'num'), el('td', '', 'num beat'), el('td', '', 'health'), el('td', succeeded ? 'finished' : ''));
      tbody.append(tr);
    }
    if (members.length > MAX_ROWS) {
      const tr = el('tr');
      const td = el('td', '… and ' + (members.length - MAX_ROWS) + ' more members');
      td.colSpan = 6;
      tr.append(td);
      tbody.append(tr);
    }
  }
  updateAges();

  const rec = j.recovery;
  if (changed('recovery', rec && [rec.recoveries, rec.timeline, rec.count, rec.goodput !== null && rec.goodput !== undefined ? rec.goodput.toFixed(3) : null])) {
    renderRecovery(rec);
  }

  const pending = j.pending.slice(0, MAX_ROWS).map((p) => p.node_id + ' (' + p.local_world_size + ' workers)');
  if (changed('pending', pending)) {
    $('pending-box').hidden = !pending.length;
    $('pending').replaceChildren(...pending.map((p) => el('li', p)));
  }

  const c = j.last_root_cause;
  if (changed('cause', [c, j.last_failure_round])) {
    $('cause-box').hidden = !c;
    if (c) {
      $('cause-round').textContent = j.last_failure_round ? '(round ' + j.last_failure_round + ')' : '';
      const lines = [briefCause(c), 'pid ' + c.pid + ', local rank ' + c.local_rank + ', restart ' + c.restart_count];
      if (c.error_file) lines.push('error file: ' + c.error_file);
      if (c.traceback) lines.push('', c.traceback);
      else if (c.stderr_tail && c.stderr_tail.length) lines.push('', ...c.stderr_tail);
      for (const o of c.other_failures || []) lines.push('also failed: rank ' + o.rank + ' (pid ' + o.pid + ')' + (o.message ? ': ' + o.message : ''));
      $('cause').textContent = lines.join('\n');
      const stacks = c.stacks || [];
      $('stacks-box').hidden = !stacks.length;
      $('stacks').replaceChildren(...stacks.map((s) => el('li', s)));
    }
  }
}

const SVG = 'http://www.w3.org/2000/svg';
const PHASES = ['noticing', 'reforming', 'starting', 'restoring', 'computing_again'];

function secs(ms) {
  return ms === null || ms === undefined ? null : (ms / 1000).toFixed(2) + ' s';
}

function svg(tag, attrs, title) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (title) {
    const t = document.createElementNS(SVG, 'title');
    t.textContent = title;
    e.append(t);
  }
  return e;
}

// Goodput, the recoveries' table, and the timeline: rounds, the recoveries' phases, and one
// lane per node (when the job names its nodes) with joins, losses and failures.
function renderRecovery(r) {
  const box = $('recovery-box');
  box.hidden = !r || r.goodput === null || r.goodput === undefined;
  if (box.hidden) return;
  $('goodput').textContent = '— goodput ' + (r.goodput * 100).toFixed(1) + ' %, ' + secs(r.lost_ms) + ' lost of ' + secs(r.wall_ms) + ', ' + r.count + (r.count === 1 ? ' recovery' : ' recoveries');
  box.dataset.goodput = r.goodput;
  box.dataset.count = r.count;

  const tbody = $('recoveries').tBodies[0];
  tbody.replaceChildren();
  for (const v of r.recoveries) {
    const p = v.phases || {};
    const tr = el('tr', null, v.ongoing ? 'ongoing' : '');
    tr.dataset.round = v.round;
    tr.dataset.kind = v.kind;
    const cell = (ms, name) => {
      const td = el('td', secs(ms) ?? (v.ongoing ? '…' : '—'), 'num');
      td.dataset.phase = name;
      if (ms !== null && ms !== undefined) td.dataset.ms = ms;
      return td;
    };
    const total = el('td', secs(v.lost_ms) + (v.ongoing ? ' …' : ''), 'num');
    total.dataset.phase = 'total';
    total.dataset.ms = v.lost_ms;
    const redone = el('td', p.steps_redone ?? '—', 'num');
    redone.dataset.phase = 'steps_redone';
    const kept = el('td', p.ranks_kept ?? '—', 'num');
    kept.dataset.phase = 'ranks_kept';
    tr.append(el('td', v.round, 'num'), el('td', v.fault), ...PHASES.map((ph) => cell(p[ph + '_ms'], ph)), redone, kept, total);
    tbody.append(tr);
  }

  const tl = $('timeline');
  tl.replaceChildren();
  const marks = r.timeline || [];
  const start = Math.min(r.began_at ?? r.now, ...marks.map((m) => m.at));
  const end = Math.max(r.now, start + 1);
  const W = 960, LEFT = 70, H_ROW = 14;
  const x = (t) => LEFT + (W - LEFT - 10) * (Math.min(Math.max(t, start), end) - start) / (end - start);
  // Nodes named by the rounds, in first-seen order: a lane each (up to 32).
  const nodes = [];
  for (const m of marks) {
    for (const n of m.node_ids || []) if (!nodes.includes(n) && nodes.length < 32) nodes.push(n);
    if (m.mark === 'joined' && !nodes.includes(m.node) && nodes.length < 32) nodes.push(m.node);
  }
  const rows = 2 + nodes.length;
  const height = 34 + rows * (H_ROW + 4);
  tl.setAttribute('viewBox', '0 0 ' + W + ' ' + height);
  const y = (row) => 4 + row * (H_ROW + 4);
  const text = (attrs, words) => {
    const t = svg('text', attrs, null);
    t.textContent = words;
    return t;
  };
  tl.append(text({ x: 2, y: y(0) + 11 }, 'rounds'), text({ x: 2, y: y(1) + 11 }, 'recoveries'));
  nodes.forEach((n, i) => tl.append(text({ x: 2, y: y(2 + i) + 11 }, n.length > 10 ? n.slice(0, 9) + '…' : n)));
  // Rounds: running from a close to the next opening (or the end), forming in between.
  let open = null, running = null;
  const endRunning = (t) => {
    if (!running) return;
    const w = Math.max(1, x(t) - x(running.at));
    const g = svg('rect', { x: x(running.at), y: y(0), width: w, height: H_ROW, class: 'tl-round' }, 'round ' + running.round + ': ' + running.nodes + ' nodes, world size ' + running.world_size);
    g.dataset.round = running.round;
    tl.append(g);
    if (w > 60) tl.append(text({ x: x(running.at) + 4, y: y(0) + 11 }, 'round ' + running.round));
    (running.node_ids || []).forEach((n) => {
      const row = 2 + nodes.indexOf(n);
      const lane = svg('rect', { x: x(running.at), y: y(row), width: Math.max(1, x(t) - x(running.at)), height: H_ROW, class: 'tl-lane' }, n + ' in round ' + running.round);
      lane.dataset.node = n;
      lane.dataset.round = running.round;
      tl.append(lane);
    });
    running = null;
  };
  for (const m of marks) {
    if (m.mark === 'round_opened') {
      endRunning(m.at);
      open = m;
    } else if (m.mark === 'round_closed') {
      if (open) tl.append(svg('rect', { x: x(open.at), y: y(0), width: Math.max(1, x(m.at) - x(open.at)), height: H_ROW, class: 'tl-forming' }, 'round ' + m.round + ' forming'));
      open = null;
      running = m;
    } else if (m.mark === 'ended') {
      endRunning(m.at);
    }
  }
  endRunning(end);
  // Each recovery's phases, end to end.
  for (const v of r.recoveries) {
    const p = v.phases || {};
    let t = v.fault_at;
    for (const ph of PHASES) {
      const ms = p[ph + '_ms'];
      if (ms === null || ms === undefined) continue;
      const g = svg('rect', { x: x(t), y: y(1), width: Math.max(1, x(t + ms) - x(t)), height: H_ROW, class: 'tl-' + ph }, 'round ' + v.round + ' ' + ph.replace('_', ' ') + ': ' + secs(ms));
      g.dataset.phase = ph;
      g.dataset.round = v.round;
      tl.append(g);
      t += ms;
    }
  }
  // Joins, losses and failures on their nodes' lanes.
  const dot = (m, node, cls, what) => {
    const row = nodes.indexOf(node);
    if (row < 0) return;
    const c = svg('circle', { cx: x(m.at), cy: y(2 + row) + H_ROW / 2, r: 4, class: cls }, node + ' ' + what);
    c.dataset.mark = m.mark;
    c.dataset.node = node;
    tl.append(c);
  };
  for (const m of marks) {
    if (m.mark === 'joined') dot(m, m.node, 'tl-joined', 'joined');
    else if (m.mark === 'lost') for (const n of m.nodes) dot(m, n, 'tl-lost', 'lost');
    else if (m.mark === 'failure') dot(m, m.node, 'tl-failure', 'rank ' + m.rank + ' failed');
  }
  const axis = height - 28;
  tl.append(svg('line', { x1: LEFT, x2: W - 10, y1: axis, y2: axis, class: 'tl-axis' }, null));
  tl.append(text({ x: W - 10, y: axis + 11, 'text-anchor': 'end' }, secs(end - start)), text({ x: LEFT, y: axis + 11 }, '0 s'));
  // The phases' colours.
  let lx = LEFT;
  for (const ph of PHASES) {
    tl.append(svg('rect', { x: lx, y: height - 11, width: 9, height: 9, class: 'tl-' + ph }, null));
    const words = ph === 'reforming' ? 're-forming' : ph.replace('_', ' ');
    tl.append(text({ x: lx + 12, y: height - 3 }, words));
    lx += 24 + words.length * 6;
  }
  tl.dataset.marks = marks.length;
}

// Heartbeat ages (and how long a node has been suspected) move on between reads: only those
// cells are written, every second.
function updateAges() {
  const j = st.job && st.job.status;
  if (!j) return;
  const since = Date.now() - st.job.at;
  const byNode = new Map(j.members.map((m) => [m.node_id, m]));
  for (const tr of $('members').tBodies[0].rows) {
    const m = byNode.get(tr.dataset.node);
    if (!m) continue;
    const beat = m.last_heartbeat_ago_ms === null || m.last_heartbeat_ago_ms === undefined ? null : m.last_heartbeat_ago_ms + since;
    const h = m.health || {};
    const suspected = h.suspected_for_ms !== null && h.suspected_for_ms !== undefined;
    const shown = suspected ? { ...h, suspected_for_ms: h.suspected_for_ms + since } : h;
    const cells = tr.cells;
    const ageText = age(beat);
    if (cells[3].textContent !== ageText) cells[3].textContent = ageText;
    const healthText = health(shown);
    if (cells[4].textContent !== healthText) cells[4].textContent = healthText;
    cells[4].classList.toggle('suspected', suspected);
  }
}

document.addEventListener('DOMContentLoaded', () => {
  $('auth-form').addEventListener('submit', (e) => {
    e.preventDefault();
    const token = $('auth-token').value.trim();
    $('auth-token').value = '';
    useToken(token);
  });
  window.addEventListener('hashchange', readFragment);
  // A hidden tab reads nothing; shown again, it catches up at once.
  document.addEventListener('visibilitychange', () => {
    if (document.hidden) return;
    refreshList();
    if (st.selected) refreshJob();
  });
  readFragment();
  refreshList();
  setInterval(updateAges, 1000);
});
