// The status page of rlaunch-rendezvous: jobs, their rounds and members, the last root cause.
// It reads the service's own API (GET /v1/jobs, GET /v1/jobs/{id}, POST /v1/jobs/{id}/watch)
// with the bearer token the user gives (URL fragment `#token=…` or the form; kept in
// sessionStorage, never sent anywhere else). The selected job is followed through the watch
// long-poll, so a new round shows at once; the list is re-read every few seconds. Everything
// from the service is written with textContent: a node id or a stack line is never markup.
'use strict';

const LIST_EVERY_MS = 3000;
const JOB_EVERY_MS = 2000;
const WATCH_WAIT_MS = 20000;
const MAX_ROWS = 500;
const TOKEN_KEY = 'rlaunch-rendezvous-token';

const st = {
  token: sessionStorage.getItem(TOKEN_KEY),
  selected: null,
  jobs: [],
  job: null, // {status, at} of the selected job, or {missing: true}
  watching: null,
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

class Unauthorized extends Error {}
class NotFound extends Error {}

async function api(path, body) {
  const headers = { Accept: 'application/json' };
  if (st.token) headers.Authorization = 'Bearer ' + st.token;
  const init = { headers, cache: 'no-store' };
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

function readFragment() {
  const h = new URLSearchParams(location.hash.slice(1));
  const token = h.get('token');
  if (token) {
    st.token = token;
    sessionStorage.setItem(TOKEN_KEY, token);
    h.delete('token');
    // The token leaves the address bar (and the history) at once.
    history.replaceState(null, '', location.pathname + location.search + (h.toString() ? '#' + h : ''));
  }
  select(h.get('job'));
}

function select(id) {
  if (id === st.selected) return;
  st.selected = id || null;
  st.job = null;
  const h = new URLSearchParams(location.hash.slice(1));
  if (st.selected) h.set('job', st.selected); else h.delete('job');
  const frag = h.toString();
  if (location.hash.slice(1) !== frag) history.replaceState(null, '', location.pathname + location.search + (frag ? '#' + frag : ''));
  renderList();
  renderJob();
  if (st.selected) {
    refreshJob();
    followJob(st.selected);
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
  try {
    st.jobs = await api('/v1/jobs');
    $('auth').hidden = true;
    $('content').hidden = false;
    setConn('live', 'live');
    if (!st.selected && st.jobs.length === 1) select(st.jobs[0].run_id);
    renderList();
  } catch (e) {
    if (onError(e)) return; // waits for a token: no timer
  }
  st.listTimer = setTimeout(refreshList, LIST_EVERY_MS);
}

async function refreshJob() {
  const id = st.selected;
  if (!id) return;
  clearTimeout(st.jobTimer);
  try {
    const status = await api('/v1/jobs/' + encodeURIComponent(id));
    if (st.selected === id) {
      st.job = { status, at: Date.now() };
      // The list shows the same job as the detail, without waiting for its own re-read.
      const i = st.jobs.findIndex((j) => j.run_id === id);
      if (i >= 0) st.jobs[i] = status; else st.jobs.push(status);
      renderList();
    }
  } catch (e) {
    if (e instanceof NotFound) {
      if (st.selected === id) st.job = { missing: true };
    } else if (onError(e)) {
      return;
    }
  }
  if (st.selected === id) {
    renderJob();
    st.jobTimer = setTimeout(refreshJob, JOB_EVERY_MS);
  }
}

// Follows one job through the watch long-poll: each answer (a new round, the job's end, or
// nothing within the wait) re-reads it, so a re-formed round shows within one request.
async function followJob(id) {
  if (st.watching === id) return;
  st.watching = id;
  while (st.selected === id) {
    const after = st.job && st.job.status ? st.job.status.round : 0;
    let ev = null;
    try {
      ev = await api('/v1/jobs/' + encodeURIComponent(id) + '/watch', { after_round: after, wait_ms: WATCH_WAIT_MS });
    } catch (e) {
      if (e instanceof Unauthorized) break;
      await sleep(JOB_EVERY_MS); // not there yet, or the service is away
      continue;
    }
    if (st.selected !== id) break;
    await refreshJob();
    if (ev.event === 'finished' || ev.event === 'failed') await sleep(5000); // over: no hurry
  }
  if (st.watching === id) st.watching = null;
}

// --- rendering ------------------------------------------------------------------------------

function briefCause(c) {
  if (!c) return '';
  const exit = c.exit && ('code' in c.exit ? 'exit ' + c.exit.code : 'signal ' + c.exit.signal);
  return 'rank ' + c.rank + ' on ' + c.host + ': ' + (c.message || exit || '');
}

function renderList() {
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
    delete box.dataset.state;
    delete box.dataset.round;
    return;
  }
  box.dataset.state = j.state;
  box.dataset.round = j.round;
  box.dataset.worldSize = j.world_size;
  const since = Date.now() - st.job.at;

  const dl = $('job-facts');
  dl.replaceChildren();
  fact(dl, 'state', j.state);
  fact(dl, 'round', j.round);
  fact(dl, 'world size', j.world_size);
  fact(dl, 'nodes', j.settings.min_nodes === j.settings.max_nodes ? j.settings.min_nodes : j.settings.min_nodes + ' to ' + j.settings.max_nodes);
  fact(dl, 'restarts', j.restart_count + ' of ' + j.max_restarts);
  fact(dl, 'last event', j.last_reason);
  fact(dl, 'failure', j.failure);
  if (j.straggler) fact(dl, 'straggler', 'rank ' + j.straggler.rank + ' on ' + j.straggler.node_id + ', ' + j.straggler.late_ms.toFixed(1) + ' ms late per step');
  if (j.fingerprint_diff && j.fingerprint_diff.length) fact(dl, 'nodes differ', j.fingerprint_diff.join('; '));

  $('member-count').textContent = '(' + j.members.length + ')';
  const tbody = $('members').tBodies[0];
  tbody.replaceChildren();
  const members = [...j.members].sort((a, b) => (a.group_rank ?? 0) - (b.group_rank ?? 0));
  for (const m of members.slice(0, MAX_ROWS)) {
    const tr = el('tr');
    tr.dataset.node = m.node_id;
    tr.dataset.groupRank = m.group_rank;
    const beat = m.last_heartbeat_ago_ms === null || m.last_heartbeat_ago_ms === undefined ? null : m.last_heartbeat_ago_ms + since;
    const h = health(m.health);
    tr.append(
      el('td', m.node_id),
      el('td', m.group_rank, 'num'),
      el('td', m.local_world_size, 'num'),
      el('td', age(beat), 'num'),
      el('td', h, m.health && m.health.suspected_for_ms != null ? 'suspected' : ''),
      el('td', m.succeeded ? 'finished' : ''),
    );
    tbody.append(tr);
  }
  if (members.length > MAX_ROWS) {
    const tr = el('tr');
    const td = el('td', '… and ' + (members.length - MAX_ROWS) + ' more members');
    td.colSpan = 6;
    tr.append(td);
    tbody.append(tr);
  }

  $('pending-box').hidden = !j.pending.length;
  const pending = $('pending');
  pending.replaceChildren(...j.pending.slice(0, MAX_ROWS).map((p) => el('li', p.node_id + ' (' + p.local_world_size + ' workers)')));

  const c = j.last_root_cause;
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

// Heartbeat ages move on between reads.
function tick() {
  if (st.job && st.job.status) renderJob();
}

document.addEventListener('DOMContentLoaded', () => {
  $('auth-form').addEventListener('submit', (e) => {
    e.preventDefault();
    st.token = $('auth-token').value.trim();
    sessionStorage.setItem(TOKEN_KEY, st.token);
    $('auth-token').value = '';
    refreshList();
    if (st.selected) {
      refreshJob();
      followJob(st.selected);
    }
  });
  window.addEventListener('hashchange', readFragment);
  readFragment();
  refreshList();
  setInterval(tick, 1000);
});
