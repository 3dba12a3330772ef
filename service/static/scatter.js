// A small SVG scatter of a sweep's trials: a parameter's value across (a linear or log
// axis, or a discrete one for a categorical parameter), the trial's metric up (linear
// or log). A mark per trial, its shape by the trial's state: complete a dot, pruned a
// cross, active a ring; the best ringed again. No library.

import { formatNumber, niceTicks } from "./chart.js";

const SVG = "http://www.w3.org/2000/svg";
const PAD = { left: 64, right: 20, top: 16, bottom: 40 };
const R = 4.5; // a mark's radius, px

function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

// Ticks on a log axis whose ends are log10(lo) and log10(hi): powers of ten when the
// range spans some, else round values within it.
function logTicks(l0, l1) {
  const lo = Math.ceil(l0);
  const hi = Math.floor(l1);
  const every = Math.max(1, Math.ceil((hi - lo + 1) / 6));
  const ticks = [];
  for (let e = lo; e <= hi; e += every) ticks.push(10 ** e);
  return ticks.length >= 2 ? ticks : niceTicks(10 ** l0, 10 ** l1, 4).filter((t) => t > 0);
}

// A numeric axis over `values` ([lo, hi] padded by 5%, or log10 of them): its map to
// [0, 1] and its ticks.
function numericAxis(values, log) {
  const f = log ? Math.log10 : (v) => v;
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    lo = Math.min(lo, f(v));
    hi = Math.max(hi, f(v));
  }
  if (!(hi > lo)) {
    lo -= 0.5;
    hi += 0.5;
  } else {
    const m = (hi - lo) * 0.05;
    lo -= m;
    hi += m;
  }
  const ticks = log ? logTicks(lo, hi) : niceTicks(lo, hi, 5);
  return { at: (v) => (f(v) - lo) / (hi - lo), ticks, label: formatNumber };
}

// A category's place: its index among `categories`, each the middle of a band.
function categoryAxis(categories) {
  const n = Math.max(1, categories.length);
  return {
    at: (v) => (categories.indexOf(v) + 0.5) / n,
    ticks: categories,
    label: (v) => String(v),
  };
}

export class ScatterChart {
  constructor(container) {
    this.container = container;
    this.data = null;
    this.root = svg("svg", { class: "chart-svg scatter-svg", role: "img" });
    this.container.replaceChildren(this.root);
    this.observer = new ResizeObserver(() => this.draw());
    this.observer.observe(container);
  }

  destroy() {
    this.observer.disconnect();
  }

  // marks: [{x (a number, or a category's text), y (a number), kind ("complete",
  // "pruned", "active"), best (bool), key, title}]; x: "linear", "log" or "category"
  // (with `categories`, in order); marks whose x or y the axes cannot place are left out.
  setData({ marks, x = "linear", categories = [], logY = false, xName = "", yName = "", empty = "" }) {
    const placeable = (m) => {
      if (!Number.isFinite(m.y) || (logY && m.y <= 0)) return false;
      if (x === "category") return categories.includes(m.x);
      return Number.isFinite(m.x) && (x !== "log" || m.x > 0);
    };
    this.data = { marks: marks.filter(placeable), x, categories, logY, xName, yName, empty };
    const d = this.container.dataset;
    d.marks = String(this.data.marks.length);
    d.xScale = x;
    d.logY = String(logY);
    this.draw();
  }

  draw() {
    if (!this.data) return;
    const { marks, x, categories, logY, xName, yName, empty } = this.data;
    const width = Math.max(200, Math.floor(this.container.clientWidth || 600));
    const height = Math.max(160, Math.floor(this.container.clientHeight || 280));
    const root = this.root;
    root.setAttribute("width", width);
    root.setAttribute("height", height);
    root.setAttribute("viewBox", `0 0 ${width} ${height}`);
    root.setAttribute("aria-label", `${yName} by ${xName}: ${marks.length} trials`);
    root.replaceChildren();
    if (!marks.length) {
      const t = svg("text", { x: width / 2, y: height / 2, class: "chart-empty" });
      t.textContent = empty || "no trial has a value yet";
      root.append(t);
      return;
    }
    const pw = width - PAD.left - PAD.right;
    const ph = height - PAD.top - PAD.bottom;
    const xa =
      x === "category"
        ? categoryAxis(categories)
        : numericAxis(marks.map((m) => m.x), x === "log");
    const ya = numericAxis(marks.map((m) => m.y), logY);
    const px = (v) => PAD.left + xa.at(v) * pw;
    const py = (v) => PAD.top + (1 - ya.at(v)) * ph;

    const grid = svg("g", { class: "chart-grid" });
    for (const t of ya.ticks) {
      const y = py(t);
      if (y < PAD.top - 1 || y > PAD.top + ph + 1) continue;
      grid.append(svg("line", { x1: PAD.left, x2: width - PAD.right, y1: y, y2: y }));
      const label = svg("text", { x: PAD.left - 6, y: y + 4, class: "tick y" });
      label.textContent = formatNumber(t);
      grid.append(label);
    }
    // A category's name under its band, cut short when the bands are narrow.
    const room = x === "category" ? Math.max(3, Math.floor(pw / Math.max(1, categories.length) / 7)) : 0;
    for (const t of xa.ticks) {
      const at = px(t);
      if (at < PAD.left - 1 || at > PAD.left + pw + 1) continue;
      grid.append(svg("line", { x1: at, x2: at, y1: PAD.top, y2: PAD.top + ph }));
      const label = svg("text", { x: at, y: PAD.top + ph + 16, class: "tick x" });
      const text = xa.label(t);
      label.textContent = room && text.length > room ? `${text.slice(0, room - 1)}…` : text;
      grid.append(label);
    }
    const xLabel = svg("text", { x: PAD.left + pw / 2, y: height - 4, class: "tick x axis-name" });
    xLabel.textContent = x === "log" ? `${xName} (log)` : xName;
    const yLabel = svg("text", { x: 4, y: PAD.top - 4, class: "tick axis-name" });
    yLabel.textContent = logY ? `${yName} (log)` : yName;
    grid.append(xLabel, yLabel);
    root.append(grid);

    // On a discrete axis the marks of a band spread a little, so equal values show apart.
    const band = x === "category" ? pw / Math.max(1, categories.length) : 0;
    const seen = new Map();
    for (const m of marks) {
      let cx = px(m.x);
      if (band) {
        const k = seen.get(m.x) || 0;
        seen.set(m.x, k + 1);
        cx += (((k * 7) % 11) / 10 - 0.5) * Math.min(band * 0.5, 40);
      }
      const cy = py(m.y);
      const g = svg("g", { class: `scatter-mark ${m.kind}`, "data-key": m.key ?? "" });
      if (m.kind === "pruned") {
        const d = `M${cx - R},${cy - R}L${cx + R},${cy + R}M${cx - R},${cy + R}L${cx + R},${cy - R}`;
        g.append(svg("path", { d }));
      } else {
        g.append(svg("circle", { cx, cy, r: R }));
      }
      if (m.best) {
        g.classList.add("best");
        g.append(svg("circle", { cx, cy, r: R + 4, class: "best-ring" }));
      }
      const title = svg("title");
      title.textContent = m.title || "";
      g.append(title);
      if (m.onClick) g.addEventListener("click", m.onClick);
      root.append(g);
    }
  }
}
