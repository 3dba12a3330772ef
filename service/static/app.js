// The ddpq dashboard: a jobs table and a job page, both polling the token-protected
// JSON routes. Every piece of data goes into the page as text (textContent or
// attributes), never as HTML, and the page's CSP forbids inline script and eval.

import { LineChart, formatNumber } from "./chart.js";

const TOKEN_KEY = "ddpq.token";
const POLL_MS = 2000;
const FIRST_LOAD_POINTS = 2000; // max_points for the first metrics fetch of a job
const KEEP_POINTS = 50000; // client-side cap on a job's metric history
const LOG_KEEP_CHARS = 256 * 1024; // the log tail kept on the page
const LOG_READS_PER_POLL = 8;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const STATES = new Set(["queued", "running", "cancelling", "succeeded", "failed", "cancelled"]);

const $ = (id) => document.getElementById(id);

// A table's rows, and its "none yet" line (#<id>-empty) shown only when there are none.
function fillTable(id, rows) {
  document.querySelector(`#${id} tbody`).replaceChildren(...rows);
  const empty = $(`${id}-empty`);
  if (empty) empty.hidden = rows.length > 0;
}

function showJobError(message) {
  $("job-error").textContent = message;
  $("job-error").hidden = false;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v == null) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, String(v));
  }
  // append() turns strings into text nodes: data is never parsed as HTML.
  for (const c of children) e.append(c == null ? "" : c instanceof Node ? c : String(c));
  return e;
}

function statusBadge(status) {
  const known = STATES.has(status) ? status : "unknown";
  return el("span", { class: `status s-${known}` }, status);
}

function age(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

function when(iso) {
  if (!iso) return "";
  return `${new Date(iso).toLocaleString()} (${age(iso)} ago)`;
}

// ---- the API, with the token ---------------------------------------------------------

let token = localStorage.getItem(TOKEN_KEY);
let asking = null;

class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

function setConn(ok, text) {
  const c = $("conn");
  c.className = ok ? "conn ok" : "conn bad";
  c.textContent = text;
}

function forgetToken() {
  token = null;
  localStorage.removeItem(TOKEN_KEY);
}

// Show the token dialog; every caller waiting for a token shares one prompt.
function askToken(message) {
  if (asking) return asking;
  const dialog = $("login");
  const input = $("token-input");
  const error = $("login-error");
  error.hidden = !message;
  error.textContent = message || "";
  input.value = "";
  asking = new Promise((resolve) => {
    const form = $("login-form");
    const submit = (ev) => {
      ev.preventDefault();
      const value = input.value.trim();
      if (!value) return;
      form.removeEventListener("submit", submit);
      token = value;
      localStorage.setItem(TOKEN_KEY, value);
      input.value = "";
      dialog.close();
      asking = null;
      resolve();
    };
    form.addEventListener("submit", submit);
  });
  if (!dialog.open) dialog.showModal();
  input.focus();
  return asking;
}

async function detailOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (typeof body.detail === "string") return body.detail;
    if (Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
  } catch {
    // not JSON: show the text itself
  }
  return text.slice(0, 300) || `HTTP ${response.status}`;
}

async function api(path, { method = "GET", raw = false } = {}) {
  for (;;) {
    if (!token) await askToken();
    const used = token;
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: { Authorization: `Bearer ${used}` },
        cache: "no-store",
        credentials: "omit",
      });
    } catch {
      setConn(false, "API unreachable, retrying");
      throw new ApiError(0, "the API is unreachable");
    }
    if (response.status === 401 || response.status === 403) {
      const detail = await detailOf(response);
      // A request sent with an older token must not throw away a newer one.
      if (token === used) forgetToken();
      await askToken(`The API refused the token: ${detail}`);
      continue;
    }
    setConn(true, `updated ${new Date().toLocaleTimeString()}`);
    if (!response.ok) throw new ApiError(response.status, await detailOf(response));
    return raw ? response : response.json();
  }
}

// ---- polling ----------------------------------------------------------------------------

// Run `fn` now and every POLL_MS after it finishes; pause while the tab is hidden and
// catch up as soon as it shows again. Returns a stop function.
function poll(fn) {
  let timer = null;
  let busy = false;
  let stopped = false;
  const tick = async () => {
    timer = null;
    if (stopped || busy || document.hidden) return;
    busy = true;
    try {
      await fn();
    } catch (e) {
      if (e.status !== 0) console.warn(e);
    } finally {
      busy = false;
    }
    if (!stopped && !document.hidden) timer = setTimeout(tick, POLL_MS);
  };
  const visible = () => {
    if (!document.hidden && !timer && !busy) tick();
  };
  document.addEventListener("visibilitychange", visible);
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
    document.removeEventListener("visibilitychange", visible);
  };
}

// ---- the jobs table ---------------------------------------------------------------------

function jobRow(job) {
  const latest = job.latest_metrics;
  const loss = latest && latest.values ? latest.values.loss : undefined;
  const href = `#/jobs/${job.id}`;
  let reason = job.reason || "";
  if (job.status === "queued" && job.queue_position != null && !reason) {
    reason = `#${job.queue_position} in the queue`;
  }
  const row = el(
    "tr",
    { "data-job-id": job.id },
    el("td", { class: "num" }, el("a", { href }, job.id)),
    el("td", { class: "name" }, el("a", { href }, job.name || job.spec.recipe || job.spec.entrypoint || "")),
    el("td", {}, statusBadge(job.status)),
    el("td", { class: "num" }, job.attempt),
    el("td", {}, job.worker || ""),
    el("td", { class: "num" }, latest ? latest.step : ""),
    el("td", { class: "num loss" }, loss === undefined ? "" : formatNumber(loss)),
    el("td", { class: "num", title: job.created_at }, age(job.created_at)),
    el("td", { class: "reason", title: reason }, reason),
  );
  row.addEventListener("click", (ev) => {
    if (ev.target.closest("a") || window.getSelection().toString()) return;
    location.hash = href;
  });
  return row;
}

function jobsView() {
  $("jobs-view").hidden = false;
  document.title = "ddpq · jobs";
  const filter = $("status-filter");
  const refresh = async () => {
    const q = new URLSearchParams({ limit: "100" });
    if (filter.value) q.set("status", filter.value);
    const data = await api(`/jobs?${q}`);
    if (stopped) return;
    const rows = data.items.map(jobRow);
    fillTable("jobs", rows);
    $("jobs-count").textContent = data.next_cursor
      ? `the newest ${rows.length} jobs`
      : `${rows.length} job${rows.length === 1 ? "" : "s"}`;
  };
  let stopped = false;
  const stopPolling = poll(refresh);
  const onFilter = () => refresh().catch(() => {});
  filter.addEventListener("change", onFilter);
  return () => {
    stopped = true;
    stopPolling();
    filter.removeEventListener("change", onFilter);
  };
}

// ---- one job ------------------------------------------------------------------------------

function fact(dl, term, value) {
  if (value === null || value === undefined || value === "") return;
  dl.append(el("dt", {}, term), el("dd", {}, value));
}

function renderFacts(job) {
  const dl = $("job-facts");
  dl.replaceChildren();
  const spec = job.spec || {};
  fact(dl, "status", statusBadge(job.status));
  fact(dl, "attempt", `${job.attempt} of ${spec.max_attempts ?? "?"}`);
  fact(dl, "reason", job.reason);
  fact(dl, "queue position", job.queue_position);
  fact(dl, "worker", job.worker);
  fact(dl, "gpus", job.gpus && job.gpus.length ? job.gpus.join(", ") : null);
  fact(dl, "exit code", job.exit_code);
  const program = spec.recipe ? `recipe ${spec.recipe}` : spec.entrypoint;
  fact(dl, "program", [program, ...(spec.args || [])].join(" "));
  fact(
    dl,
    "ranks",
    `${spec.world_size ?? 1} on ${spec.nnodes ?? 1} node(s), device ${spec.device ?? "auto"}`,
  );
  fact(dl, "priority", spec.priority);
  fact(dl, "created", when(job.created_at));
  fact(dl, "started", when(job.started_at));
  fact(dl, "finished", when(job.finished_at));
}

function cellValue(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return formatNumber(v);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

const ago = (t) => (t ? el("td", { title: t }, `${age(t)} ago`) : el("td", {}, ""));

function renderAttempts(items) {
  const rows = items.map((a) =>
    el(
      "tr",
      {},
      el("td", { class: "num" }, a.number),
      el("td", {}, statusBadge(a.outcome)),
      el("td", {}, a.worker),
      el("td", {}, a.gpus.join(",")),
      ago(a.started_at),
      ago(a.finished_at),
      el("td", { class: "num" }, cellValue(a.exit_code)),
      el("td", {}, a.reason ?? ""),
    ),
  );
  fillTable("attempts", rows);
}

function renderCheckpoints(items) {
  const rows = items.map((c) =>
    el(
      "tr",
      {},
      el("td", { class: "num" }, c.step),
      el("td", { class: "num" }, cellValue(c.epoch)),
      el("td", { class: "num" }, c.attempt),
      el("td", { class: "path" }, c.path),
      el("td", {}, Object.entries(c.metrics || {}).map(([k, v]) => `${k}=${formatNumber(v)}`).join(" ")),
      el("td", { class: "num", title: c.created_at }, age(c.created_at)),
    ),
  );
  fillTable("checkpoints", rows);
}

function jobView(id) {
  $("job-view").hidden = false;
  $("job-title").textContent = `Job ${id}`;
  $("job-status").replaceChildren();
  $("job-facts").replaceChildren();
  $("job-error").hidden = true;
  $("log").textContent = "";
  $("log-info").textContent = "";
  $("chart-info").textContent = "";
  $("metric-select").replaceChildren();
  renderAttempts([]);
  renderCheckpoints([]);

  const chart = new LineChart($("chart"));
  const st = {
    job: null,
    points: [],
    metricsSeen: null, // latest_metrics as last fetched, to skip fetches that bring nothing
    attempt: null,
    logOffset: 0,
    logText: "",
    decoder: new TextDecoder(),
    checkpoints: [],
    checkpointSeen: undefined,
    attemptsSeen: null,
    settled: false, // terminal and fetched once more after it
  };
  let stopped = false;

  const selected = () => $("metric-select").value || "loss";

  const drawChart = () => {
    const name = selected();
    const pts = [];
    for (const p of st.points) {
      const v = p.values[name];
      if (typeof v === "number") pts.push({ x: p.step, y: v });
    }
    chart.setData(pts, { logY: $("log-scale").checked, label: name });
    $("chart-info").textContent = pts.length
      ? `${pts.length} points, latest ${formatNumber(pts[pts.length - 1].y)} at step ${pts[pts.length - 1].x}`
      : "";
  };

  const updateMetricNames = () => {
    const select = $("metric-select");
    const names = new Set();
    for (const p of st.points) for (const k of Object.keys(p.values)) names.add(k);
    const have = [...select.options].map((o) => o.value);
    const want = [...names].sort();
    if (want.join("\n") === have.join("\n")) return;
    const current = select.value || (names.has("loss") ? "loss" : want[0]);
    select.replaceChildren(...want.map((n) => el("option", { value: n }, n)));
    if (current) select.value = current;
  };

  const loadMetrics = async (full) => {
    if (full || !st.points.length) {
      const data = await api(`/jobs/${id}/metrics?max_points=${FIRST_LOAD_POINTS}`);
      if (stopped) return;
      st.points = data.items;
    } else {
      // since_step is inclusive: the last step comes again, with any values added since.
      const since = st.points[st.points.length - 1].step;
      const data = await api(`/jobs/${id}/metrics?since_step=${since}`);
      if (stopped) return;
      while (st.points.length && st.points[st.points.length - 1].step >= since) st.points.pop();
      for (const p of data.items) st.points.push(p);
      if (st.points.length > KEEP_POINTS) st.points = st.points.filter((_, i) => i % 2 === 0 || i === st.points.length - 1);
    }
    updateMetricNames();
    drawChart();
  };

  const appendLog = (text) => {
    if (!text) return;
    const pre = $("log");
    st.logText = (st.logText + text).slice(-LOG_KEEP_CHARS);
    pre.textContent = st.logText;
    if ($("log-follow").checked) pre.scrollTop = pre.scrollHeight;
  };

  const loadLog = async () => {
    for (let i = 0; i < LOG_READS_PER_POLL; i++) {
      const r = await api(`/jobs/${id}/logs?offset=${st.logOffset}`, { raw: true });
      const bytes = await r.arrayBuffer();
      if (stopped) return;
      const next = Number(r.headers.get("X-Next-Offset"));
      if (!bytes.byteLength || !Number.isFinite(next) || next <= st.logOffset) break;
      st.logOffset = next;
      appendLog(st.decoder.decode(bytes, { stream: true }));
      if (bytes.byteLength < 64 * 1024) break; // a short read: we are at the end
    }
    $("log-info").textContent = st.logOffset ? `${st.logOffset} bytes` : "empty so far";
  };

  const loadCheckpoints = async () => {
    const data = await api(`/jobs/${id}/checkpoints`);
    if (stopped) return;
    st.checkpoints = data.items;
    renderCheckpoints(st.checkpoints);
  };

  const loadAttempts = async () => {
    const data = await api(`/jobs/${id}/attempts`);
    if (stopped) return;
    renderAttempts(data.items);
  };

  const renderJob = (job) => {
    st.job = job;
    $("job-title").textContent = job.name ? `Job ${job.id} · ${job.name}` : `Job ${job.id}`;
    $("job-status").replaceChildren(statusBadge(job.status));
    document.title = `ddpq · job ${job.id} · ${job.status}`;
    renderFacts(job);
    $("cancel").disabled = TERMINAL.has(job.status) || job.status === "cancelling";
  };

  const refresh = async () => {
    if (st.settled) {
      // Nothing changes any more; only the "ago" of its times moves on.
      if (st.job) renderFacts(st.job);
      renderCheckpoints(st.checkpoints);
      return;
    }
    let job;
    try {
      job = await api(`/jobs/${id}`);
    } catch (e) {
      if (e.status === 404 && !stopped) {
        showJobError(`There is no job ${id}.`);
        st.settled = true;
      }
      throw e;
    }
    if (stopped) return;
    renderJob(job);
    const newAttempt = st.attempt !== null && job.attempt !== st.attempt;
    st.attempt = job.attempt;
    const work = [loadLog()];
    const metricsNow = JSON.stringify(job.latest_metrics);
    if (newAttempt || metricsNow !== st.metricsSeen) {
      // A new attempt may report steps again (resuming from a checkpoint): refetch all.
      work.push(loadMetrics(newAttempt).then(() => { st.metricsSeen = metricsNow; }));
    }
    const checkpointNow = job.latest_checkpoint ? job.latest_checkpoint.id : null;
    if (checkpointNow !== st.checkpointSeen) {
      work.push(loadCheckpoints().then(() => { st.checkpointSeen = checkpointNow; }));
    } else {
      renderCheckpoints(st.checkpoints); // their ages move on
    }
    const attemptsNow = `${job.attempt}/${job.status}/${job.worker}`;
    if (attemptsNow !== st.attemptsSeen) {
      work.push(loadAttempts().then(() => { st.attemptsSeen = attemptsNow; }));
    }
    await Promise.all(work);
    // A finished job changes no more: one last round after it ended, then stop asking.
    if (TERMINAL.has(job.status)) st.settled = true;
  };

  const onCancel = async () => {
    if (!st.job || !confirm(`Cancel job ${id}${st.job.name ? ` (${st.job.name})` : ""}?`)) return;
    $("cancel").disabled = true;
    try {
      renderJob(await api(`/jobs/${id}/cancel`, { method: "POST" }));
      st.settled = false;
    } catch (e) {
      showJobError(`Cancel failed: ${e.message}`);
      $("cancel").disabled = false;
    }
  };
  const onMetric = () => drawChart();
  const onScroll = () => {
    const pre = $("log");
    $("log-follow").checked = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  };

  $("cancel").addEventListener("click", onCancel);
  $("metric-select").addEventListener("change", onMetric);
  $("log-scale").addEventListener("change", onMetric);
  $("log").addEventListener("scroll", onScroll);
  const stopPolling = poll(refresh);
  return () => {
    stopped = true;
    stopPolling();
    chart.destroy();
    $("cancel").removeEventListener("click", onCancel);
    $("metric-select").removeEventListener("change", onMetric);
    $("log-scale").removeEventListener("change", onMetric);
    $("log").removeEventListener("scroll", onScroll);
  };
}

// ---- routing ---------------------------------------------------------------------------

let leave = () => {};

function route() {
  leave();
  $("jobs-view").hidden = true;
  $("job-view").hidden = true;
  const m = location.hash.match(/^#\/jobs\/(\d{1,18})$/);
  leave = m ? jobView(Number(m[1])) : jobsView();
}

$("login").addEventListener("cancel", (ev) => ev.preventDefault()); // the token is required
$("forget").addEventListener("click", () => {
  forgetToken();
  askToken("Token forgotten. Enter a token to go on.");
});
window.addEventListener("hashchange", route);
route();
