// A job's GPUs (its system metrics, sampled by its worker through NVML): a row each,
// its use now and a small chart of its use over time (the job page).

import { $, age, el } from "./common.js";

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
export function renderGpus(items) {
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
