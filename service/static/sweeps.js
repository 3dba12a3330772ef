// Sweeps: #/sweeps lists them (GET /sweeps), #/sweeps/N shows one (GET /sweeps/N): its
// settings, its trials ranked as the API ranks them, its table exported (CSV), a
// parameter against the metric (a mark per trial), and the trials' curves overlaid.

import { COLOURS, LineChart, formatNumber } from "./chart.js";
import {
  $,
  age,
  api,
  cellValue,
  el,
  fact,
  fillTable,
  numberOf,
  poll,
  statusBadge,
  when,
} from "./common.js";
import { currentRun } from "./history.js";
import { ScatterChart } from "./scatter.js";

const CURVES_MAX = 40; // trials drawn at once (the best first): beyond it, a blur
const CURVE_POINTS = 600; // max_points of each trial's curve

// ---- the list ---------------------------------------------------------------------------

function best(sweep) {
  const b = sweep.best;
  if (!b) return "";
  const value = formatNumber(numberOf(b.value));
  return `${sweep.spec.metric} ${value} (trial ${b.number}, job ${b.job_id ?? "-"})`;
}

function sweepRow(w) {
  const href = `#/sweeps/${w.id}`;
  const row = el(
    "tr",
    { "data-sweep-id": w.id },
    el("td", { class: "num" }, el("a", { href }, w.id)),
    el("td", { class: "name" }, el("a", { href }, w.name || `sweep ${w.id}`)),
    el("td", { class: "owner" }, w.owner),
    el("td", {}, statusBadge(w.status)),
    el("td", {}, w.spec.method),
    el("td", { class: "num" }, `${w.trials_made}/${w.max_trials}`),
    el("td", { class: "num" }, w.counts.active),
    el("td", { class: "best" }, best(w)),
    el("td", { class: "num", title: w.created_at }, age(w.created_at)),
    el("td", { class: "reason", title: w.reason ?? "" }, w.reason ?? ""),
  );
  row.addEventListener("click", (ev) => {
    if (ev.target.closest("a") || window.getSelection().toString()) return;
    location.hash = href;
  });
  return row;
}

export function sweepsView() {
  $("sweeps-view").hidden = false;
  document.title = "ddpq · sweeps";
  let stopped = false;
  const stopPolling = poll(async () => {
    const data = await api("/sweeps?limit=100");
    if (stopped) return;
    const rows = data.items.map(sweepRow);
    fillTable("sweeps", rows);
    $("sweeps-count").textContent = data.next_cursor
      ? `the newest ${rows.length} sweeps`
      : `${rows.length} sweep${rows.length === 1 ? "" : "s"}`;
  });
  return () => {
    stopped = true;
    stopPolling();
  };
}

// ---- one sweep ------------------------------------------------------------------------------

// Early stopping in words: "asha: min_steps 100, reduction_factor 3".
function stopping(es) {
  if (!es) return "none";
  const set = Object.entries(es).filter(([k, v]) => k !== "type" && v != null);
  return set.length ? `${es.type}: ${set.map(([k, v]) => `${k} ${v}`).join(", ")}` : es.type;
}

function counts(c) {
  const parts = ["active", "paused", "complete", "pruned", "failed", "cancelled"]
    .filter((k) => c[k])
    .map((k) => `${c[k]} ${k}`);
  return parts.join(", ");
}

// A trial's metric and its step: its final (or pruned) value, else its latest (marked …).
function trialValue(t) {
  if (t.value != null) return { y: numberOf(t.value), step: t.step, text: formatNumber(numberOf(t.value)) };
  if (t.latest != null) {
    return { y: numberOf(t.latest), step: t.latest_step, text: `${formatNumber(numberOf(t.latest))}…` };
  }
  return { y: NaN, step: null, text: "" };
}

// A parameter's value as the scatter's discrete axis and the table show it.
const paramText = (v) => (typeof v === "string" ? v : JSON.stringify(v));

// The scatter's x axis for a parameter of the space: log where the space draws it
// log-uniformly, discrete for a categorical (its values in order) or a fixed one.
function axisOf(param, trials, name) {
  if (param.type === "categorical") return { x: "category", categories: param.values.map(paramText) };
  if (param.type === "fixed") return { x: "category", categories: [paramText(param.value)] };
  if (param.type === "float" || param.type === "int") return { x: param.log ? "log" : "linear" };
  // Not in the space (never: the sweep made them): as the values come.
  const values = [...new Set(trials.map((t) => paramText(t.params[name])))];
  return { x: "category", categories: values };
}

function renderFacts(sweep) {
  const s = sweep.spec;
  const dl = $("sweep-facts");
  dl.replaceChildren();
  fact(dl, "owner", sweep.owner);
  fact(dl, "reason", sweep.reason);
  fact(dl, "method", `${s.method} (seed ${sweep.seed})`);
  fact(dl, "metric", `${s.direction} ${s.metric}`);
  fact(dl, "early stopping", stopping(s.early_stopping));
  const made = `${sweep.trials_made} of ${sweep.max_trials}, ${s.max_concurrent} at once`;
  const c = counts(sweep.counts);
  fact(dl, "trials", c ? `${made} (${c})` : made);
  fact(dl, "best", best(sweep));
  fact(dl, "created", when(sweep.created_at));
  fact(dl, "finished", when(sweep.finished_at));
}

// The trials' table: a header for this sweep's parameters, a row per trial as ranked.
function renderTrials(sweep, names, chosen) {
  const s = sweep.spec;
  const head = ["", "rank", "trial", "job", "state", s.metric, "step", ...names, "reason"];
  const numeric = new Set([1, 2, 3, 5, 6]);
  const tr = $("trials").querySelector("thead tr");
  if ([...tr.children].map((th) => th.textContent).join("\n") !== head.join("\n")) {
    const cls = (i) => (numeric.has(i) ? "num" : i ? null : "pick");
    tr.replaceChildren(...head.map((h, i) => el("th", { class: cls(i) }, h)));
  }
  const rows = sweep.trials.map((t) => {
    const v = trialValue(t);
    const job = t.job_id == null ? "-" : el("a", { href: `#/jobs/${t.job_id}` }, t.job_id);
    const pick = t.job_id == null
      ? ""
      : el("input", {
          type: "checkbox",
          value: t.number,
          "aria-label": `choose trial ${t.number}`,
          ...(chosen.has(t.number) ? { checked: "" } : {}),
        });
    return el(
      "tr",
      { "data-trial": t.number, "data-state": t.state },
      el("td", { class: "pick" }, pick),
      el("td", { class: "num rank" }, t.rank ?? ""),
      el("td", { class: "num trial" }, t.number),
      el("td", { class: "num" }, job),
      el("td", {}, statusBadge(t.state)),
      el("td", { class: "num value" }, v.text),
      el("td", { class: "num" }, v.step ?? ""),
      ...names.map((n) => el("td", { class: "param" }, n in t.params ? cellValue(t.params[n]) : "")),
      el("td", { class: "reason", title: t.reason ?? "" }, t.reason ?? ""),
    );
  });
  fillTable("trials", rows);
}

export function sweepView(id) {
  $("sweep-view").hidden = false;
  $("sweep-title").textContent = `Sweep ${id}`;
  $("sweep-status").replaceChildren();
  $("sweep-facts").replaceChildren();
  $("sweep-error").hidden = true;
  $("trials").querySelector("thead tr").replaceChildren();
  fillTable("trials", []);
  $("scatter-param").replaceChildren();
  $("trials-info").textContent = "";
  $("scatter-info").textContent = "";
  $("curves-info").textContent = "";
  $("sweep-compare").hidden = true;

  const scatter = new ScatterChart($("scatter"));
  const chart = new LineChart($("sweep-chart"));
  const st = {
    sweep: null,
    settled: false,
    chosen: new Set(), // trial numbers ticked: their curves only (none: every trial's)
    curves: new Map(), // trial number -> {seen, points}
    param: null, // the scatter's parameter, once the user picks one
  };
  let stopped = false;
  const showError = (message) => {
    $("sweep-error").textContent = message;
    $("sweep-error").hidden = false;
  };

  const paramNames = (sweep) => Object.keys(sweep.spec.space);
  // Parameters that vary first: a fixed one is the same for every trial.
  const scatterNames = (sweep) => {
    const space = sweep.spec.space;
    const names = paramNames(sweep);
    const fixed = (n) => space[n].type === "fixed";
    return [...names.filter((n) => !fixed(n)), ...names.filter(fixed)];
  };

  const drawScatter = () => {
    const sweep = st.sweep;
    if (!sweep) return;
    const names = scatterNames(sweep);
    const select = $("scatter-param");
    if ([...select.options].map((o) => o.value).join("\n") !== names.join("\n")) {
      select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    }
    const name = st.param && names.includes(st.param) ? st.param : names[0];
    select.value = name;
    const param = sweep.spec.space[name];
    const axis = axisOf(param, sweep.trials, name);
    const bestNumber = sweep.best ? sweep.best.number : null;
    const marks = sweep.trials
      .map((t) => {
        const v = trialValue(t);
        const raw = t.params[name];
        return {
          x: axis.x === "category" ? paramText(raw) : typeof raw === "number" ? raw : NaN,
          y: v.y,
          kind: t.state,
          best: t.number === bestNumber,
          key: t.number,
          title:
            `trial ${t.number} (job ${t.job_id ?? "-"}, ${t.state}): ${name} ` +
            `${paramText(raw)}, ${sweep.spec.metric} ${v.text || "none"}`,
          onClick: t.job_id == null ? null : () => { location.hash = `#/jobs/${t.job_id}`; },
        };
      });
    scatter.setData({
      marks,
      ...axis,
      logY: $("sweep-log").checked,
      xName: name,
      yName: sweep.spec.metric,
    });
    const shown = Number($("scatter").dataset.marks);
    const without = sweep.trials.length - shown;
    $("scatter-info").textContent = without
      ? `${shown} of ${sweep.trials.length} trials (${without} without a value yet)`
      : `${shown} trials`;
  };

  // The trials whose curves are drawn: those ticked, else every trial (the best first).
  const curveTrials = () => {
    const trials = (st.sweep ? st.sweep.trials : []).filter((t) => t.job_id != null);
    const picked = st.chosen.size ? trials.filter((t) => st.chosen.has(t.number)) : trials;
    return picked.slice(0, CURVES_MAX);
  };

  const drawCurves = () => {
    const sweep = st.sweep;
    if (!sweep) return;
    const metric = sweep.spec.metric;
    const series = curveTrials()
      .filter((t) => st.curves.has(t.number))
      .map((t) => ({
        name: `trial ${t.number} (job ${t.job_id})`,
        key: t.number,
        colour: t.number % COLOURS,
        // A pruned (or paused) trial's curve is dashed: it stopped at a rung, not at its end.
        cls: { pruned: "dashed", paused: "dashed", active: "live" }[t.state] ?? null,
        points: st.curves.get(t.number).points,
      }));
    chart.setData(series, { logY: $("sweep-log").checked, empty: `no ${metric} reported yet` });
    const all = sweep.trials.filter((t) => t.job_id != null).length;
    const which = st.chosen.size ? `${series.length} chosen trials` : `${series.length} of ${all} trials`;
    const cut = all > CURVES_MAX && !st.chosen.size ? ` (the best ${CURVES_MAX})` : "";
    $("curves-info").textContent = `${metric} of ${which}${cut}`;
  };

  // Each drawn trial's curve, fetched again only when the trial moved on.
  const loadCurves = async () => {
    const metric = st.sweep.spec.metric;
    const work = curveTrials().map(async (t) => {
      const seen = `${t.status}/${t.state}/${t.step}/${t.latest_step}/${t.value}/${t.latest}`;
      const had = st.curves.get(t.number);
      if (had && had.seen === seen) return;
      const q = new URLSearchParams({ name: metric, max_points: String(CURVE_POINTS) });
      const data = await api(`/jobs/${t.job_id}/metrics?${q}`);
      if (!stopped) st.curves.set(t.number, { seen, points: currentRun(data.items, metric) });
    });
    const results = await Promise.allSettled(work);
    const failed = results.find((r) => r.status === "rejected" && r.reason.status !== 404);
    if (failed) throw failed.reason;
  };

  const showChosen = () => {
    const link = $("sweep-compare");
    const jobs = (st.sweep ? st.sweep.trials : [])
      .filter((t) => st.chosen.has(t.number) && t.job_id != null)
      .map((t) => t.job_id);
    link.hidden = jobs.length < 2;
    link.setAttribute("href", `#/compare?jobs=${jobs.join(",")}`);
    link.textContent = `Compare ${jobs.length} chosen`;
  };

  const render = () => {
    const sweep = st.sweep;
    $("sweep-title").textContent = sweep.name ? `Sweep ${sweep.id} · ${sweep.name}` : `Sweep ${sweep.id}`;
    $("sweep-status").replaceChildren(statusBadge(sweep.status));
    document.title = `ddpq · sweep ${sweep.id} · ${sweep.status}`;
    renderFacts(sweep);
    renderTrials(sweep, paramNames(sweep), st.chosen);
    $("trials-info").textContent =
      `ranked by ${sweep.spec.metric} (${sweep.spec.direction}): ` +
      "complete, then pruned, active, the rest";
    drawScatter();
    drawCurves();
    showChosen();
  };

  const refresh = async () => {
    if (st.settled) return;
    let sweep;
    try {
      sweep = await api(`/sweeps/${id}`);
    } catch (e) {
      if (e.status === 404 && !stopped) {
        showError(`There is no sweep ${id}.`);
        st.settled = true;
      }
      throw e;
    }
    if (stopped) return;
    st.sweep = sweep;
    render();
    await loadCurves();
    if (stopped) return;
    drawCurves();
    // An ended sweep changes no more once its trials' jobs have: one round after it.
    if (sweep.status !== "running" && sweep.counts.active === 0) st.settled = true;
  };

  const onPick = (ev) => {
    if (!ev.target.matches("td.pick input")) return;
    const n = Number(ev.target.value);
    if (ev.target.checked) st.chosen.add(n);
    else st.chosen.delete(n);
    showChosen();
    drawCurves();
    loadCurves().then(drawCurves, (e) => console.warn(e));
  };
  const onParam = () => {
    st.param = $("scatter-param").value;
    drawScatter();
  };
  const onLog = () => {
    drawScatter();
    drawCurves();
  };
  const onRow = (ev) => {
    const row = ev.target.closest("tr[data-trial]");
    if (!row || ev.target.closest("a, td.pick") || window.getSelection().toString()) return;
    const box = row.querySelector("td.pick input");
    if (box) box.click();
  };
  // The table as CSV, asked with the token (a plain link would go without it): saved
  // from a blob the page makes.
  const onExport = async () => {
    try {
      const r = await api(`/sweeps/${id}/export?format=csv`, { raw: true });
      const blob = await r.blob();
      const url = URL.createObjectURL(blob);
      const a = el("a", { href: url, download: `sweep-${id}.csv` });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (e) {
      showError(`Export failed: ${e.message}`);
    }
  };
  $("trials").addEventListener("change", onPick);
  $("trials").addEventListener("click", onRow);
  $("scatter-param").addEventListener("change", onParam);
  $("sweep-log").addEventListener("change", onLog);
  $("sweep-export").addEventListener("click", onExport);
  const stopPolling = poll(refresh);
  return () => {
    stopped = true;
    stopPolling();
    scatter.destroy();
    chart.destroy();
    $("trials").removeEventListener("change", onPick);
    $("trials").removeEventListener("click", onRow);
    $("scatter-param").removeEventListener("change", onParam);
    $("sweep-log").removeEventListener("change", onLog);
    $("sweep-export").removeEventListener("click", onExport);
  };
}
