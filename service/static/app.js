// The ddpq dashboard: a jobs table and a job page, both polling the token-protected
// JSON routes, and the routes to the other views (sweeps.js, compare.js). Every piece of
// data goes into the page as text (textContent or attributes), never as HTML, and the
// page's CSP forbids inline script and eval.

import { COLOURS, LineChart, formatNumber } from "./chart.js";
import {
  $,
  TERMINAL,
  age,
  api,
  askToken,
  cellValue,
  checkWho,
  currentViewer,
  el,
  fact,
  fillTable,
  forgetToken,
  hasToken,
  onWho,
  poll,
  setViewerChanged,
  statusBadge,
  when,
} from "./common.js";
import { auditView, queueView, usageView, workersView } from "./box.js";
import { compareView } from "./compare.js";
import { BEHIND_REFRESH_MS, MetricHistory, chartNote, historyPoints } from "./history.js";
import { renderGpus } from "./gpus.js";
import { sweepView, sweepsView } from "./sweeps.js";

// Samples of each GPU's history fetched (GET /jobs/{id}/gpus): its small chart's width.
const GPU_POINTS = 300;
const LOG_KEEP_CHARS = 256 * 1024; // the log tail kept on the page
const LOG_READS_PER_POLL = 8;

function showJobError(message) {
  $("job-error").textContent = message;
  $("job-error").hidden = false;
}

// The API's rule (service/jobs.py cancel_job): an admin cancels any job, a member their
// own. Not offered until the page knows who the token is.
function mayCancel(job) {
  const viewer = currentViewer();
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
onWho((who) => addOwners([who.name]));

// ---- the jobs table ---------------------------------------------------------------------

// The jobs chosen (by their row's checkbox) for "Compare": kept while the page lives, as
// the table is drawn again at every poll.
const chosenJobs = new Set();

function showChosen() {
  const n = chosenJobs.size;
  $("compare-jobs").disabled = n < 2;
  $("compare-jobs").textContent = n ? `Compare ${n} job${n === 1 ? "" : "s"}` : "Compare";
}

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
    el(
      "td",
      { class: "pick" },
      el("input", {
        type: "checkbox",
        value: job.id,
        "aria-label": `choose job ${job.id} to compare`,
        ...(chosenJobs.has(job.id) ? { checked: "" } : {}),
      }),
    ),
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
    if (ev.target.closest("a, td.pick") || window.getSelection().toString()) return;
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
  const onPick = (ev) => {
    if (!ev.target.matches("td.pick input")) return;
    const id = Number(ev.target.value);
    if (ev.target.checked) chosenJobs.add(id);
    else chosenJobs.delete(id);
    showChosen();
  };
  const onCompare = () => {
    location.hash = `#/compare?jobs=${[...chosenJobs].sort((a, b) => a - b).join(",")}`;
  };
  showChosen();
  filter.addEventListener("change", onFilter);
  owner.addEventListener("change", onFilter);
  $("jobs").addEventListener("change", onPick);
  $("compare-jobs").addEventListener("click", onCompare);
  api("/usage").then((usage) => addOwners(usage.items.map((u) => u.user)), () => {});
  return () => {
    stopped = true;
    stopPolling();
    filter.removeEventListener("change", onFilter);
    owner.removeEventListener("change", onFilter);
    $("jobs").removeEventListener("change", onPick);
    $("compare-jobs").removeEventListener("click", onCompare);
  };
}

// ---- one job ------------------------------------------------------------------------------

// A worker, and the Slurm job id of an attempt a Slurm bridge runs (as `ddpq ls` shows it).
function where(worker, externalId) {
  if (!worker) return "";
  return externalId ? `${worker} (Slurm job ${externalId})` : worker;
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
  const history = new MetricHistory(historyPoints($("chart").clientWidth || 600));
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
    const smoothing = Number($("smoothing").value);
    $("smoothing-value").textContent = smoothing.toFixed(2);
    chart.setData(series, { logY: $("log-scale").checked, empty, smoothing });
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
  setViewerChanged(() => {
    if (st.job) renderActions(st.job);
    else $("cancel").hidden = true;
  });
  $("cancel").addEventListener("click", onCancel);
  $("metric-list").addEventListener("change", onPick);
  $("log-scale").addEventListener("change", onMetric);
  $("smoothing").addEventListener("input", onMetric);
  $("log").addEventListener("scroll", onScroll);
  const stopPolling = poll(refresh);
  return () => {
    stopped = true;
    stopPolling();
    chart.destroy();
    setViewerChanged(() => {});
    $("cancel").removeEventListener("click", onCancel);
    $("metric-list").removeEventListener("change", onPick);
    $("log-scale").removeEventListener("change", onMetric);
    $("smoothing").removeEventListener("input", onMetric);
    $("log").removeEventListener("scroll", onScroll);
  };
}

// ---- routing ---------------------------------------------------------------------------

let leave = () => {};
const VIEWS = [
  "jobs-view", "job-view", "sweeps-view", "sweep-view", "compare-view",
  "queue-view", "workers-view", "usage-view", "audit-view",
];

// #/jobs/N a job, #/sweeps the sweeps, #/sweeps/N a sweep, #/compare?jobs=1,2 a
// comparison of jobs, #/queue, #/workers, #/usage, #/audit the box (box.js); anything
// else the jobs table.
function route() {
  leave();
  for (const id of VIEWS) $(id).hidden = true;
  const hash = location.hash;
  let m;
  if ((m = hash.match(/^#\/jobs\/(\d{1,18})$/))) leave = jobView(Number(m[1]));
  else if (/^#\/sweeps\/?$/.test(hash)) leave = sweepsView();
  else if ((m = hash.match(/^#\/sweeps\/(\d{1,18})$/))) leave = sweepView(Number(m[1]));
  else if ((m = hash.match(/^#\/compare(?:\?(.*))?$/))) leave = compareView(m[1] || "");
  else if (/^#\/queue\/?$/.test(hash)) leave = queueView();
  else if (/^#\/workers\/?$/.test(hash)) leave = workersView();
  else if (/^#\/usage\/?$/.test(hash)) leave = usageView();
  else if (/^#\/audit\/?$/.test(hash)) leave = auditView();
  else leave = jobsView();
}

$("login").addEventListener("cancel", (ev) => ev.preventDefault()); // the token is required
$("forget").addEventListener("click", () => {
  forgetToken();
  askToken("Token forgotten. Enter a token to go on.");
});
window.addEventListener("hashchange", route);
route();
if (hasToken()) checkWho(); // else when the token is entered
