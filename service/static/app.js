// The ddpq dashboard: a jobs table and a job page, both polling the token-protected
// JSON routes. Every piece of data goes into the page as text (textContent or
// attributes), never as HTML, and the page's CSP forbids inline script and eval.

import { COLOURS, LineChart, formatNumber } from "./chart.js";

const TOKEN_KEY = "ddpq.token";
const POLL_MS = 2000;
// max_points of every metrics fetch: about two points per pixel of the chart's width.
const HISTORY_POINTS = { min: 500, max: 4000, perPixel: 2 };
// While a new attempt reports again steps an earlier one reached, the job's latest step
// does not move: its metrics are then fetched again at most this often.
const BEHIND_REFRESH_MS = 10000;
// Samples of each GPU's history fetched (GET /jobs/{id}/gpus): its small chart's width.
const GPU_POINTS = 300;
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
  showWho(null);
}

// Who the token is (GET /whoami, once per token): the actions a page offers depend on it.
let viewer = null;
let viewerChanged = () => {}; // the open view's, to show or hide its actions again

// Who the token is: "signed in as alice (member)" in the header.
function showWho(who) {
  viewer = who;
  const w = $("whoami");
  w.textContent = who ? `signed in as ${who.name} (${who.role})` : "";
  w.hidden = !who;
  if (who) addOwners([who.name]);
  viewerChanged();
}

// The API's rule (service/jobs.py cancel_job): an admin cancels any job, a member their
// own. Not offered until the page knows who the token is.
function mayCancel(job) {
  if (!viewer) return false;
  return viewer.role === "admin" || (job.owner != null && job.owner === viewer.name);
}

// The owner filter's names: the signed-in user's, the owners of the jobs listed and the
// users GET /usage counts (a member may read it; GET /users is for admins). Names are
// only added, in order, so the list never changes under the pointer.
function addOwners(names) {
  const select = $("owner-filter");
  for (const name of names) {
    const options = [...select.options].slice(1); // after "everyone"
    if (!name || options.some((o) => o.value === name)) continue;
    const after = options.find((o) => o.value > name) ?? null;
    select.insertBefore(el("option", { value: name }, name), after);
  }
}

// Ask the API who the token is (GET /whoami): when the page starts with a stored token,
// and each time a token is entered. A token that is not a user's is asked for again.
async function checkWho() {
  const asked = token;
  try {
    const who = await api("/whoami");
    if (token === asked) showWho(who);
  } catch (e) {
    if (e.status !== 0) console.warn(e);
  }
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
      checkWho();
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
    // 401: no such token. 403 on /whoami: a token, but not a user's (a worker's). A 403
    // elsewhere is the API refusing what a user asked (another's job): an error to show.
    if (response.status === 401 || (response.status === 403 && path === "/whoami")) {
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
    el("td", { class: "owner" }, job.owner ?? ""),
    el("td", {}, statusBadge(job.status)),
    el("td", { class: "num" }, job.attempt),
    el("td", {}, where(job.worker, job.external_id)),
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
  const owner = $("owner-filter");
  // The server filters, as `ddpq ls --user` asks it to.
  const refresh = async () => {
    const q = new URLSearchParams({ limit: "100" });
    if (filter.value) q.set("status", filter.value);
    if (owner.value) q.set("user", owner.value);
    const data = await api(`/jobs?${q}`);
    if (stopped) return;
    addOwners(data.items.map((job) => job.owner));
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
  owner.addEventListener("change", onFilter);
  api("/usage").then((usage) => addOwners(usage.items.map((u) => u.user)), () => {});
  return () => {
    stopped = true;
    stopPolling();
    filter.removeEventListener("change", onFilter);
    owner.removeEventListener("change", onFilter);
  };
}

// ---- a job's metric history --------------------------------------------------------------

// A value as a number: the API sends NaN and the infinities as names.
const numberOf = (v) =>
  typeof v === "number" ? v : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : NaN;

// Lowest to highest as the API ranks values (service/metrics.py): NaN above every number.
const rankBelow = (a, b) => (Number.isNaN(a) ? false : Number.isNaN(b) ? true : a < b);

// At most `maxPoints` of `pts` (sorted by x) that keep their shape, as the API
// downsamples: equal spans of steps, each keeping its lowest and highest point, and the
// first and the last point.
function thinHistory(pts, maxPoints) {
  if (pts.length <= maxPoints) return pts;
  const buckets = Math.max(1, Math.floor((maxPoints - 2) / 2));
  const lo = pts[0].x;
  const span = pts[pts.length - 1].x - lo + 1;
  const low = new Map();
  const high = new Map();
  pts.forEach((p, i) => {
    const b = Math.floor(((p.x - lo) * buckets) / span);
    if (!low.has(b) || rankBelow(p.y, pts[low.get(b)].y)) low.set(b, i);
    if (!high.has(b) || rankBelow(pts[high.get(b)].y, p.y)) high.set(b, i);
  });
  const keep = new Set([0, pts.length - 1, ...low.values(), ...high.values()]);
  return [...keep].sort((a, b) => a - b).map((i) => pts[i]);
}

// A job's metric series over the whole run, as its current attempt sees it, at a bounded
// cost (as `ddpq watch` keeps its loss, ddpq/cli/live.py). It is fetched once downsampled
// (max_points), then only what is new: from the current attempt's newest step on, still
// with max_points, so an answer stays small however far the job got meanwhile; never the
// whole history again until the attempt changes. A series kept here is thinned as the API
// downsamples once it passes twice max_points. A new attempt resumes from a checkpoint
// and reports its steps again: points of earlier attempts from the step it started
// reporting at are left out, so the lines end where the attempt is.
//
// It also keeps how many points each series has in the API (`held`, from the answers'
// `series`) and which series it holds fewer of (`downsampled`), for the note under the
// chart. An answer from `since` on counts again what the API held from there: what the
// previous answer counted from there is taken off first, by the steps it sent (exact
// unless that answer was itself downsampled past `since`, which keeps at least the
// newest point: only a new attempt's leftovers can be off).
class MetricHistory {
  constructor(maxPoints) {
    this.maxPoints = maxPoints;
    this.reset(0);
  }

  reset(attempt) {
    this.attempt = attempt;
    this.series = new Map(); // name -> [{x: step, y: number, a: attempt}] by step
    this.held = new Map(); // name -> the points the API holds of it
    this.downsampled = new Set(); // names of which fewer points are kept than it holds
    this.answered = new Map(); // name -> the steps the last answer sent
    this.loaded = false;
    this.behind = false; // earlier attempts' points lie past the current one's newest
    this.fetchedAt = -Infinity;
  }

  names() {
    return [...this.series.keys()].sort();
  }

  // The current attempt's newest step, or -1.
  newest() {
    let newest = -1;
    for (const pts of this.series.values()) {
      for (let i = pts.length - 1; i >= 0; i--) {
        if (pts[i].a >= this.attempt) {
          newest = Math.max(newest, pts[i].x);
          break;
        }
      }
    }
    return newest;
  }

  // The query of the next fetch and where it starts (null: the whole run). Before the
  // current attempt reported anything, it starts at the step the attempt resumes from.
  next(resumeStep) {
    const q = new URLSearchParams({ max_points: String(this.maxPoints) });
    if (!this.loaded) return { q, since: null };
    const newest = this.newest();
    const since = newest >= 0 ? newest : resumeStep;
    q.set("since_step", String(since));
    return { q, since };
  }

  // Take an answer to next()'s query (`series`: its counts; none from an older API).
  take(items, since, series = {}) {
    this.loaded = true;
    this.fetchedAt = Date.now();
    if (since === null) {
      this.series = new Map();
      this.held = new Map();
      this.downsampled = new Set();
    } else {
      for (const [name, pts] of this.series) this.series.set(name, pts.filter((p) => p.x < since));
      for (const [name, held] of this.held) {
        const again = (this.answered.get(name) || []).filter((x) => x >= since).length;
        this.held.set(name, held - again);
      }
    }
    this.answered = new Map();
    for (const [name, c] of Object.entries(series)) {
      this.held.set(name, (this.held.get(name) || 0) + c.points);
      if (c.downsampled) this.downsampled.add(name);
    }
    for (const item of items) {
      for (const [name, v] of Object.entries(item.values)) {
        if (!this.series.has(name)) this.series.set(name, []);
        this.series.get(name).push({ x: item.step, y: numberOf(v), a: item.attempt });
        if (!this.answered.has(name)) this.answered.set(name, []);
        this.answered.get(name).push(item.step);
      }
    }
    let first = Infinity;
    for (const pts of this.series.values()) {
      const own = pts.find((p) => p.a >= this.attempt);
      if (own) first = Math.min(first, own.x);
    }
    const newest = this.newest();
    this.behind = false;
    for (const [name, pts] of this.series) {
      if (pts.some((p) => p.a < this.attempt && (newest < 0 || p.x > newest))) this.behind = true;
      const kept = first === Infinity ? pts : pts.filter((p) => p.a >= this.attempt || p.x < first);
      if (kept.length > 2 * this.maxPoints) {
        this.series.set(name, thinHistory(kept, this.maxPoints));
        this.downsampled.add(name);
      } else {
        this.series.set(name, kept);
      }
    }
  }
}

const count = (n) => n.toLocaleString("en-US");

// The note under the chart: which series drawn show fewer points than they have, and
// whether retention downsampled the job's series in storage (the chart cannot tell).
function chartNote(history, names, job) {
  const notes = [];
  for (const name of names) {
    const shown = (history.series.get(name) || []).length;
    if (!shown || !history.downsampled.has(name)) continue;
    const held = history.held.get(name);
    notes.push(
      held > shown
        ? `${name}: ${count(shown)} of ${count(held)} points shown (downsampled)`
        : `${name}: ${count(shown)} points shown (downsampled)`,
    );
  }
  if (job && job.metrics_downsampled > 0) {
    notes.push(
      `this job's series were downsampled in storage after it ended: ` +
        `${count(job.metrics_downsampled)} points removed (DDPQ_METRICS_DOWNSAMPLE_AFTER)`,
    );
  }
  return notes;
}

// ---- one job ------------------------------------------------------------------------------

// A worker, and the Slurm job id of an attempt a Slurm bridge runs (as `ddpq ls` shows it).
function where(worker, externalId) {
  if (!worker) return "";
  return externalId ? `${worker} (Slurm job ${externalId})` : worker;
}

function fact(dl, term, value) {
  if (value === null || value === undefined || value === "") return;
  dl.append(el("dt", {}, term), el("dd", {}, value));
}

// The progress bar: the latest step of the job's total_steps (its program reports it).
function progress(job) {
  const total = job.total_steps;
  if (!Number.isInteger(total) || total < 1) return null;
  const step = job.latest_metrics ? job.latest_metrics.step : 0;
  const done = Math.min(step, total);
  return el(
    "span",
    { class: "progress" },
    el("progress", { max: total, value: done }),
    `step ${done} of ${total} (${Math.floor((100 * done) / total)}%)`,
  );
}

function renderFacts(job) {
  const dl = $("job-facts");
  dl.replaceChildren();
  const spec = job.spec || {};
  fact(dl, "status", statusBadge(job.status));
  fact(dl, "owner", job.owner);
  fact(dl, "attempt", `${job.attempt} of ${spec.max_attempts ?? "?"}`);
  fact(dl, "reason", job.reason);
  fact(dl, "queue position", job.queue_position);
  fact(dl, "worker", job.worker ? where(job.worker, job.external_id) : null);
  fact(dl, "gpus", job.gpus && job.gpus.length ? job.gpus.join(", ") : null);
  fact(dl, "exit code", job.exit_code);
  fact(dl, "progress", progress(job));
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
      el("td", {}, where(a.worker, a.external_id)),
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
      // A directory a framework wrote ends with "/", as `ddpq checkpoints` shows it.
      el("td", { class: "path" }, c.kind === "dir" ? `${c.path}/` : c.path),
      el("td", {}, Object.entries(c.metrics || {}).map(([k, v]) => `${k}=${formatNumber(v)}`).join(" ")),
      el("td", { class: "num", title: c.created_at }, age(c.created_at)),
      // Retention (docs/checkpoints.md): kept, pruning, pruned or refused, and why.
      el(
        "td",
        { class: c.state === "kept" ? "" : "muted", title: c.note ?? "" },
        (c.state ?? "kept") + (c.keep ? " (keep)" : ""),
      ),
    ),
  );
  fillTable("checkpoints", rows);
}

// ---- a job's GPUs (its system metrics, sampled by its worker through NVML) -------------------

const gib = (n) => (n / 2 ** 30).toFixed(1);

// A GPU's utilisation and memory used (% of its total) over the samples' span, 0 to 100.
function sparkline(samples) {
  const SVG = "http://www.w3.org/2000/svg";
  const spark = document.createElementNS(SVG, "svg");
  spark.setAttribute("class", "gpu-spark");
  spark.setAttribute("viewBox", "0 0 100 100");
  spark.setAttribute("preserveAspectRatio", "none");
  spark.setAttribute("role", "img");
  const frame = document.createElementNS(SVG, "rect");
  for (const [k, v] of Object.entries({ x: 0, y: 0, width: 100, height: 100 })) frame.setAttribute(k, v);
  spark.append(frame);
  if (samples.length < 2) return spark;
  const t0 = Date.parse(samples[0].time);
  const span = Math.max(1, Date.parse(samples[samples.length - 1].time) - t0);
  const x = (s) => ((100 * (Date.parse(s.time) - t0)) / span).toFixed(2);
  const lines = [
    (s) => s.utilization,
    (s) => (s.memory_total ? (100 * s.memory_used) / s.memory_total : 0),
  ];
  lines.forEach((y, i) => {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", `series-${i}`);
    line.setAttribute("points", samples.map((s) => `${x(s)},${(100 - y(s)).toFixed(2)}`).join(" "));
    spark.append(line);
  });
  const secs = Math.round(span / 1000);
  spark.setAttribute("aria-label", `utilisation and memory over the last ${secs} s`);
  return spark;
}

// A row per GPU: what it is, its use now, its use over time. No GPU (no NVML on the
// job's worker, a CPU job): no panel at all.
function renderGpus(items) {
  $("gpus-panel").hidden = items.length === 0;
  const rows = items.map((g) => {
    const now = g.latest;
    return el(
      "div",
      { class: "gpu", "data-gpu": `${g.worker}:${g.gpu}` },
      el(
        "div",
        { class: "gpu-name" },
        `GPU ${g.gpu}${g.name ? ` · ${g.name}` : ""}`,
        el("small", {}, g.uuid ? `${g.worker} · ${g.uuid}` : g.worker),
      ),
      el(
        "div",
        { class: "gpu-meter gpu-util", title: "utilisation" },
        el("meter", { min: 0, max: 100, value: now.utilization }),
        `${Math.round(now.utilization)}%`,
      ),
      el(
        "div",
        { class: "gpu-meter gpu-mem", title: "memory used" },
        el("meter", { min: 0, max: now.memory_total || 1, value: now.memory_used }),
        `${gib(now.memory_used)} / ${gib(now.memory_total)} GiB`,
      ),
      sparkline(g.samples),
    );
  });
  $("gpus").replaceChildren(...rows);
  const newest = items.map((g) => g.latest.time).sort().pop();
  $("gpus-info").textContent = newest ? `sampled ${age(newest)} ago` : "";
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
  $("chart-note").textContent = "";
  $("chart-note").hidden = true;
  $("metric-list").replaceChildren($("metric-list").querySelector("legend"));
  renderAttempts([]);
  renderCheckpoints([]);
  renderGpus([]);

  const chart = new LineChart($("chart"));
  const width = $("chart").clientWidth || 600;
  const { min, max, perPixel } = HISTORY_POINTS;
  const history = new MetricHistory(Math.min(max, Math.max(min, perPixel * width)));
  const st = {
    job: null,
    metricsSeen: null, // latest_metrics as last fetched, to skip fetches that bring nothing
    logOffset: 0,
    logText: "",
    decoder: new TextDecoder(),
    checkpoints: [],
    checkpointSeen: undefined,
    attemptsSeen: null,
    settled: false, // terminal and fetched once more after it
  };
  // The series on the chart: loss and val_loss (or the first) until the user picks.
  const picks = { chosen: null, colours: new Map() };
  let stopped = false;

  const selected = () => {
    const names = history.names();
    if (picks.chosen) return names.filter((n) => picks.chosen.has(n));
    const usual = names.filter((n) => n === "loss" || n === "val_loss");
    return usual.length ? usual : names.slice(0, 1);
  };

  // A series keeps the colour it got when it first showed up.
  const colourOf = (name) => {
    if (!picks.colours.has(name)) picks.colours.set(name, picks.colours.size % COLOURS);
    return picks.colours.get(name);
  };

  const drawChart = () => {
    const names = selected();
    const series = names.map((name) => ({
      name,
      colour: colourOf(name),
      points: history.series.get(name) || [],
    }));
    const empty = history.names().length ? "pick a series to draw" : "no metrics reported yet";
    chart.setData(series, { logY: $("log-scale").checked, empty });
    const latest = [];
    let first = Infinity;
    let last = -Infinity;
    for (const s of chart.series) {
      const p = s.points[s.points.length - 1];
      latest.push(`${s.name} ${formatNumber(p.y)} at step ${p.x}`);
      first = Math.min(first, s.points[0].x);
      last = Math.max(last, p.x);
    }
    $("chart-info").textContent = latest.length
      ? `steps ${first} to ${last}; latest: ${latest.join(", ")}`
      : "";
    const notes = chartNote(history, names, st.job);
    $("chart-note").textContent = notes.join("; ");
    $("chart-note").hidden = !notes.length;
  };

  const updateMetricList = () => {
    const list = $("metric-list");
    const names = history.names();
    const have = [...list.querySelectorAll("input")].map((i) => i.value);
    const on = new Set(selected());
    if (names.join("\n") === have.join("\n")) {
      for (const input of list.querySelectorAll("input")) input.checked = on.has(input.value);
      return;
    }
    const items = names.map((name) =>
      el(
        "label",
        {},
        el("input", { type: "checkbox", value: name }),
        el("span", { class: `swatch series-${colourOf(name)}` }),
        name,
      ),
    );
    list.replaceChildren(list.querySelector("legend"), ...items);
    for (const input of list.querySelectorAll("input")) input.checked = on.has(input.value);
  };

  const loadMetrics = async () => {
    const resume = st.job && st.job.latest_checkpoint ? st.job.latest_checkpoint.step : 0;
    const { q, since } = history.next(resume);
    const attempt = history.attempt;
    const data = await api(`/jobs/${id}/metrics?${q}`);
    if (stopped || attempt !== history.attempt) return;
    history.take(data.items, since, data.series || {});
    updateMetricList();
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

  // The GPUs of the job's current attempt (its history, a new attempt's GPUs apart).
  const loadGpus = async () => {
    const data = await api(`/jobs/${id}/gpus?max_points=${GPU_POINTS}`);
    if (stopped) return;
    renderGpus(data.items.filter((g) => st.job && g.attempt === st.job.attempt));
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
    renderActions(job);
  };

  // Cancel only where the viewer may take it; disabled once the job is ending or ended.
  const renderActions = (job) => {
    $("cancel").hidden = !mayCancel(job);
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
    const work = [loadLog()];
    if (job.attempt !== history.attempt) {
      // A new attempt may report steps again (resuming from a checkpoint): the whole
      // run is fetched again, once.
      history.reset(job.attempt);
      st.metricsSeen = null;
    }
    const metricsNow = JSON.stringify(job.latest_metrics);
    const behind = history.behind && Date.now() - history.fetchedAt >= BEHIND_REFRESH_MS;
    if (metricsNow !== st.metricsSeen || behind) {
      work.push(loadMetrics().then(() => { st.metricsSeen = metricsNow; }));
    }
    const checkpointNow = job.latest_checkpoint ? job.latest_checkpoint.id : null;
    if (checkpointNow !== st.checkpointSeen) {
      work.push(loadCheckpoints().then(() => { st.checkpointSeen = checkpointNow; }));
    } else {
      renderCheckpoints(st.checkpoints); // their ages move on
    }
    // A job that holds GPUs: their use, each round (its workers sample every few seconds).
    if (job.gpus && job.gpus.length) work.push(loadGpus());
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
  const onPick = () => {
    const checked = [...$("metric-list").querySelectorAll("input:checked")].map((i) => i.value);
    picks.chosen = new Set(checked);
    drawChart();
  };
  const onScroll = () => {
    const pre = $("log");
    $("log-follow").checked = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  };

  $("cancel").hidden = true; // until the job and the viewer are known
  viewerChanged = () => {
    if (st.job) renderActions(st.job);
    else $("cancel").hidden = true;
  };
  $("cancel").addEventListener("click", onCancel);
  $("metric-list").addEventListener("change", onPick);
  $("log-scale").addEventListener("change", onMetric);
  $("log").addEventListener("scroll", onScroll);
  const stopPolling = poll(refresh);
  return () => {
    stopped = true;
    stopPolling();
    chart.destroy();
    viewerChanged = () => {};
    $("cancel").removeEventListener("click", onCancel);
    $("metric-list").removeEventListener("change", onPick);
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
if (token) checkWho(); // else when the token is entered
