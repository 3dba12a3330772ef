// Runs compared: #/compare?jobs=12,13,14. One metric of each job as its own series on one
// chart (smoothed or raw, on a linear or log scale), and a table of each job: its state,
// the metric's last and best value, and a trial's parameters. Each job's history is
// fetched and followed as the job page's is (history.js), polling while a job runs.

import { COLOURS, LineChart, formatNumber } from "./chart.js";
import { $, TERMINAL, api, cellValue, el, fillTable, poll, statusBadge } from "./common.js";
import { BEHIND_REFRESH_MS, MetricHistory, chartNote, historyPoints } from "./history.js";

export const MAX_COMPARED = 24; // jobs on one chart: beyond it, the lines are a blur
// A metric whose best is its highest, by its name (accuracy, a score); else the lowest.
const HIGHER_IS_BETTER = new RegExp(
  "(^|[_./-])(acc|accuracy|auc|f1|precision|recall|bleu|rouge|map|iou|miou|reward|return" +
    "|score|top[15]|r2)([_./-]|$)",
  "i",
);

// The jobs of `query` ("jobs=12,13,14"): distinct ids in the order given.
export function comparedIds(query) {
  const raw = new URLSearchParams(query).get("jobs") || "";
  const ids = [];
  for (const part of raw.split(",")) {
    const t = part.trim();
    if (/^\d{1,18}$/.test(t) && Number(t) > 0 && !ids.includes(Number(t))) ids.push(Number(t));
  }
  return ids;
}

export const higherIsBetter = (metric) => HIGHER_IS_BETTER.test(metric);

// The metric drawn first: the first (by name) every job has, `loss` if they all have it;
// else the first any job has.
export function defaultMetric(namesPerJob) {
  const lists = namesPerJob.filter((names) => names.length);
  if (!lists.length) return null;
  const shared = lists[0].filter((n) => lists.every((names) => names.includes(n))).sort();
  if (shared.includes("loss")) return "loss";
  if (shared.length) return shared[0];
  return [...new Set(lists.flat())].sort()[0];
}

// The last point and the best one (the lowest, or the highest with `max`) of a series.
function lastAndBest(points, max) {
  let best = null;
  let last = null;
  for (const p of points) {
    if (!Number.isFinite(p.y)) continue;
    last = p;
    if (!best || (max ? p.y > best.y : p.y < best.y)) best = p;
  }
  return { last: points.length ? points[points.length - 1] : last, best };
}

const jobName = (job) => job.name || job.spec.recipe || job.spec.entrypoint || "";
const jobLabel = (id, job) => (job && job.name ? `${id} · ${job.name}` : `job ${id}`);

export function compareView(query) {
  $("compare-view").hidden = false;
  const all = comparedIds(query);
  const ids = all.slice(0, MAX_COMPARED);
  $("compare-title").textContent = ids.length ? `Compare jobs ${ids.join(", ")}` : "Compare jobs";
  document.title = `ddpq · compare ${ids.join(", ")}`;
  const error = $("compare-error");
  error.hidden = true;
  const problems = [];
  if (!ids.length) {
    problems.push("No jobs to compare: tick them in the jobs table, or open #/compare?jobs=12,13.");
  }
  if (all.length > ids.length) problems.push(`Only the first ${MAX_COMPARED} jobs are compared.`);
  const showProblems = (more = []) => {
    const words = [...problems, ...more];
    error.textContent = words.join(" ");
    error.hidden = !words.length;
  };
  showProblems();
  $("compare-metric").replaceChildren();
  $("compare-info").textContent = "";
  $("compare-note").hidden = true;
  $("compare-table").querySelector("thead tr").replaceChildren();
  fillTable("compare-table", []);

  const chart = new LineChart($("compare-chart"));
  const points = historyPoints($("compare-chart").clientWidth || 600);
  const runs = ids.map((id, i) => ({
    id,
    colour: i % COLOURS,
    job: null,
    missing: false,
    history: new MetricHistory(points),
    metricsSeen: null,
    settled: false,
  }));
  const picks = { metric: null, best: null }; // the user's, once they choose
  let stopped = false;

  const metric = () => {
    const names = runs.map((r) => r.history.names());
    if (picks.metric && names.some((n) => n.includes(picks.metric))) return picks.metric;
    return defaultMetric(names);
  };
  const wantsMax = (name) => (picks.best ? picks.best === "max" : higherIsBetter(name || ""));

  // The metric picker: every metric a job has, those not every job has said so.
  const updateMetrics = (chosen) => {
    const select = $("compare-metric");
    const counts = new Map();
    for (const r of runs) for (const n of r.history.names()) counts.set(n, (counts.get(n) || 0) + 1);
    const names = [...counts.keys()].sort();
    const having = runs.filter((r) => r.history.names().length).length;
    const labels = names.map((n) =>
      counts.get(n) < having ? `${n} (${counts.get(n)} of ${having} jobs)` : n,
    );
    const have = [...select.options].map((o) => o.textContent);
    if (labels.join("\n") !== have.join("\n")) {
      select.replaceChildren(...names.map((n, i) => el("option", { value: n }, labels[i])));
    }
    if (chosen) select.value = chosen;
  };

  const renderTable = (name, max) => {
    const params = [];
    for (const r of runs) {
      for (const p of Object.keys((r.job && r.job.spec && r.job.spec.params) || {})) {
        if (!params.includes(p)) params.push(p);
      }
    }
    const head = [
      "job", "name", "state", `last ${name || ""}`.trim(), "step",
      `best (${max ? "highest" : "lowest"})`, "at step", "points", ...params,
    ];
    const numeric = new Set([0, 3, 4, 5, 6, 7]);
    const tr = $("compare-table").querySelector("thead tr");
    if ([...tr.children].map((th) => th.textContent).join("\n") !== head.join("\n")) {
      tr.replaceChildren(...head.map((h, i) => el("th", { class: numeric.has(i) ? "num" : null }, h)));
    }
    const rows = runs.map((r) => {
      const pts = (name && r.history.series.get(name)) || [];
      const { last, best } = lastAndBest(pts, max);
      const held = name ? r.history.held.get(name) : undefined;
      const job = r.job;
      return el(
        "tr",
        { "data-job-id": r.id },
        el(
          "td",
          { class: "num" },
          el("span", { class: `swatch series-${r.colour}` }),
          " ",
          el("a", { href: `#/jobs/${r.id}` }, r.id),
        ),
        el("td", { class: "name" }, r.missing ? "no such job" : job ? jobName(job) : ""),
        el("td", {}, job ? statusBadge(job.status) : ""),
        el("td", { class: "num last" }, last ? formatNumber(last.y) : ""),
        el("td", { class: "num" }, last ? last.x : ""),
        el("td", { class: "num best" }, best ? formatNumber(best.y) : ""),
        el("td", { class: "num" }, best ? best.x : ""),
        el("td", { class: "num" }, pts.length ? (held ?? pts.length).toLocaleString("en-US") : ""),
        ...params.map((p) => {
          const v = job && job.spec.params ? job.spec.params[p] : undefined;
          return el("td", { class: "param" }, v === undefined ? "" : cellValue(v));
        }),
      );
    });
    fillTable("compare-table", rows);
  };

  const draw = () => {
    const name = metric();
    updateMetrics(name);
    const max = wantsMax(name);
    $("compare-best").value = max ? "max" : "min";
    const series = runs
      .filter((r) => name && r.history.series.has(name))
      .map((r) => ({
        name: jobLabel(r.id, r.job),
        key: r.id,
        colour: r.colour,
        points: r.history.series.get(name),
      }));
    const smoothing = Number($("compare-smoothing").value);
    $("compare-smoothing-value").textContent = smoothing.toFixed(2);
    const loaded = runs.every((r) => r.missing || r.history.loaded);
    const empty = loaded ? "none of these jobs reported a metric yet" : "loading…";
    chart.setData(series, { logY: $("compare-log").checked, empty, smoothing });
    const without = runs.filter((r) => !r.missing && r.history.loaded && !r.history.series.has(name));
    $("compare-info").textContent = name
      ? `${name} of ${series.length} job${series.length === 1 ? "" : "s"}` +
        (without.length ? `; not reported by ${without.map((r) => r.id).join(", ")}` : "")
      : "";
    const notes = runs.flatMap((r) =>
      name ? chartNote(r.history, [name], r.job).map((n) => `job ${r.id}: ${n}`) : [],
    );
    $("compare-note").textContent = notes.join("; ");
    $("compare-note").hidden = !notes.length;
    renderTable(name, max);
  };

  const loadMetrics = async (r) => {
    const resume = r.job && r.job.latest_checkpoint ? r.job.latest_checkpoint.step : 0;
    const { q, since } = r.history.next(resume);
    const attempt = r.history.attempt;
    const data = await api(`/jobs/${r.id}/metrics?${q}`);
    if (stopped || attempt !== r.history.attempt) return;
    r.history.take(data.items, since, data.series || {});
  };

  // One job's round, as the job page's: the job, then what is new of its metrics; a job
  // that ended is fetched once more, then left alone.
  const refreshRun = async (r) => {
    if (r.settled) return;
    let job;
    try {
      job = await api(`/jobs/${r.id}`);
    } catch (e) {
      if (e.status === 404) {
        r.missing = true;
        r.settled = true;
        return;
      }
      throw e;
    }
    if (stopped) return;
    r.job = job;
    if (job.attempt !== r.history.attempt) {
      r.history.reset(job.attempt);
      r.metricsSeen = null;
    }
    const now = JSON.stringify(job.latest_metrics);
    const behind = r.history.behind && Date.now() - r.history.fetchedAt >= BEHIND_REFRESH_MS;
    if (now !== r.metricsSeen || behind) {
      await loadMetrics(r);
      r.metricsSeen = now;
    }
    if (TERMINAL.has(job.status)) r.settled = true;
  };

  const refresh = async () => {
    const results = await Promise.allSettled(runs.map(refreshRun));
    if (stopped) return;
    const missing = runs.filter((r) => r.missing).map((r) => r.id);
    showProblems(missing.length ? [`There is no job ${missing.join(", ")}.`] : []);
    draw();
    const failed = results.find((x) => x.status === "rejected");
    if (failed) throw failed.reason;
  };

  const onMetric = () => {
    picks.metric = $("compare-metric").value || null;
    draw();
  };
  const onBest = () => {
    picks.best = $("compare-best").value;
    draw();
  };
  const onDraw = () => draw();
  $("compare-metric").addEventListener("change", onMetric);
  $("compare-best").addEventListener("change", onBest);
  $("compare-smoothing").addEventListener("input", onDraw);
  $("compare-log").addEventListener("change", onDraw);
  const stopPolling = ids.length ? poll(refresh) : () => {};
  if (!ids.length) draw();
  return () => {
    stopped = true;
    stopPolling();
    chart.destroy();
    $("compare-metric").removeEventListener("change", onMetric);
    $("compare-best").removeEventListener("change", onBest);
    $("compare-smoothing").removeEventListener("input", onDraw);
    $("compare-log").removeEventListener("change", onDraw);
  };
}
