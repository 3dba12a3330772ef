// A small SVG line chart of one or more series over steps, on one shared y axis: nice
// ticks, optional log scale, optional smoothing (an EMA, the raw line drawn faint under
// it), min/max-per-pixel thinning for long histories, a legend and a hover read-out. The
// job page draws a job's metrics with it; the comparison and sweep pages one metric of
// several jobs. No library.

const SVG = "http://www.w3.org/2000/svg";
const PAD = { left: 64, right: 16, top: 28, bottom: 28 };
export const COLOURS = 8; // .series-0 .. .series-7 in style.css

function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

// About `count` round tick values covering [lo, hi].
export function niceTicks(lo, hi, count = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) ?? 10 * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
  }
  return ticks;
}

export function formatNumber(v) {
  if (typeof v !== "number") return v == null ? "" : String(v);
  if (!Number.isFinite(v)) return String(v);
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

// Keep the first and last point of each pixel column and its minimum and maximum,
// so a long history keeps its shape (spikes included) at a few points per pixel.
function thin(points, width, xOf) {
  if (points.length <= width * 4) return points;
  const out = [];
  let col = null;
  let bucket = [];
  const flush = () => {
    if (!bucket.length) return;
    let lo = bucket[0];
    let hi = bucket[0];
    for (const p of bucket) {
      if (p.y < lo.y) lo = p;
      if (p.y > hi.y) hi = p;
    }
    const keep = new Set([bucket[0], lo, hi, bucket[bucket.length - 1]]);
    for (const p of bucket) if (keep.has(p)) out.push(p);
    bucket = [];
  };
  for (const p of points) {
    const c = Math.floor(xOf(p.x));
    if (c !== col) {
      flush();
      col = c;
    }
    bucket.push(p);
  }
  flush();
  return out;
}

// TensorBoard's smoothing: an exponential moving average of the values with weight
// `weight` (0: the raw values), debiased so that the first points are not pulled
// towards zero. A non-finite value is kept as it is and leaves the average alone.
export function smooth(points, weight) {
  if (!(weight > 0)) return points;
  let last = 0;
  let n = 0;
  return points.map((p) => {
    if (!Number.isFinite(p.y)) return p;
    last = last * weight + (1 - weight) * p.y;
    n += 1;
    return { ...p, y: last / (1 - weight ** n) };
  });
}

// The index of the point of `pts` (sorted by x) nearest to `x`.
function nearest(pts, x) {
  let lo = 0;
  let hi = pts.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (pts[mid].x < x) lo = mid + 1;
    else hi = mid;
  }
  if (lo > 0 && Math.abs(pts[lo - 1].x - x) < Math.abs(pts[lo].x - x)) lo -= 1;
  return lo;
}

export class LineChart {
  constructor(container) {
    this.container = container;
    this.series = [];
    this.names = [];
    this.empty = "no metrics reported yet";
    this.hoverX = null;
    this.logY = false;
    this.root = svg("svg", { class: "chart-svg", role: "img" });
    this.container.replaceChildren(this.root);
    this.observer = new ResizeObserver(() => this.draw());
    this.observer.observe(container);
    this.root.addEventListener("mousemove", (ev) => this.hover(ev));
    this.root.addEventListener("mouseleave", () => this.hover(null));
  }

  destroy() {
    this.observer.disconnect();
  }

  // series: [{name, colour (0..COLOURS-1), points: [{x: step, y: value}] sorted by x,
  // key (optional: its data-key), cls (optional: more classes of its line, "dashed")}];
  // non-finite values are left out (and values <= 0 on a log scale). `smoothing`: the
  // EMA's weight, 0 to below 1 (0: raw); each series' raw line is then drawn faint.
  setData(series, { logY = false, empty = "no metrics reported yet", smoothing = 0 } = {}) {
    this.logY = logY;
    this.empty = empty;
    this.smoothing = smoothing > 0 && smoothing < 1 ? smoothing : 0;
    this.names = series.map((s) => s.name);
    this.series = series
      .map((s) => {
        const raw = s.points.filter((p) => Number.isFinite(p.y) && (!logY || p.y > 0));
        return { ...s, raw, points: smooth(raw, this.smoothing) };
      })
      .filter((s) => s.points.length);
    const d = this.container.dataset;
    d.points = String(this.series.reduce((n, s) => n + s.points.length, 0));
    d.series = String(this.series.length);
    d.logY = String(logY);
    d.smoothing = String(this.smoothing);
    const [x0, x1] = this.xRange();
    d.firstStep = this.series.length ? String(x0) : "";
    d.lastStep = this.series.length ? String(x1) : "";
    this.draw();
  }

  xRange() {
    let x0 = Infinity;
    let x1 = -Infinity;
    for (const s of this.series) {
      x0 = Math.min(x0, s.points[0].x);
      x1 = Math.max(x1, s.points[s.points.length - 1].x);
    }
    return [x0, x1];
  }

  draw() {
    const width = Math.max(200, Math.floor(this.container.clientWidth || 600));
    const height = Math.max(160, Math.floor(this.container.clientHeight || 260));
    const root = this.root;
    root.setAttribute("width", width);
    root.setAttribute("height", height);
    root.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const count = this.series.reduce((n, s) => n + s.points.length, 0);
    root.setAttribute("aria-label", `${this.names.join(", ")}: ${count} points`);
    root.replaceChildren();
    this.layout = null;
    if (!this.series.length) {
      const t = svg("text", { x: width / 2, y: height / 2, class: "chart-empty" });
      t.textContent = this.names.length ? `no ${this.names.join(", ")} reported yet` : this.empty;
      root.append(t);
      return;
    }
    const fy = this.logY ? Math.log10 : (v) => v;
    let [x0, x1] = this.xRange();
    let y0 = Infinity;
    let y1 = -Infinity;
    for (const s of this.series) {
      for (const p of this.smoothing ? [...s.raw, ...s.points] : s.points) {
        const v = fy(p.y);
        if (v < y0) y0 = v;
        if (v > y1) y1 = v;
      }
    }
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) {
      y0 -= 0.5;
      y1 += 0.5;
    } else {
      const m = (y1 - y0) * 0.05;
      y0 -= m;
      y1 += m;
    }
    // The legend, in the band above the plot: a stroke of each series' colour, its name;
    // as many rows as the names take (several jobs' names are long), the plot below them.
    const legend = svg("g", { class: "chart-legend" });
    let lx = PAD.left;
    let ly = 14;
    for (const s of this.series) {
      const wide = 21 + 7 * s.name.length + 16;
      if (lx > PAD.left && lx + wide > width - PAD.right) {
        lx = PAD.left;
        ly += 18;
      }
      const item = svg("g", { class: `chart-legend-item series-${s.colour}`, "data-name": s.name });
      item.append(svg("line", { x1: lx, x2: lx + 16, y1: ly, y2: ly }));
      const label = svg("text", { x: lx + 21, y: ly + 4 });
      label.textContent = s.name;
      item.append(label);
      legend.append(item);
      lx += wide;
    }
    const top = PAD.top + ly - 14;
    const pw = width - PAD.left - PAD.right;
    const ph = Math.max(40, height - top - PAD.bottom);
    const xOf = (x) => PAD.left + ((x - x0) / (x1 - x0)) * pw;
    const yOf = (v) => top + (1 - (fy(v) - y0) / (y1 - y0)) * ph;

    const grid = svg("g", { class: "chart-grid" });
    let yTicks;
    if (this.logY) {
      // Powers of ten when the range spans some; else round values within the decade.
      const lo = Math.ceil(y0);
      const hi = Math.floor(y1);
      const every = Math.max(1, Math.ceil((hi - lo + 1) / 6));
      yTicks = [];
      for (let e = lo; e <= hi; e += every) yTicks.push(10 ** e);
      if (yTicks.length < 2) yTicks = niceTicks(10 ** y0, 10 ** y1, 4).filter((t) => t > 0);
    } else {
      yTicks = niceTicks(y0, y1, 5);
    }
    for (const t of yTicks) {
      const y = yOf(t);
      grid.append(svg("line", { x1: PAD.left, x2: width - PAD.right, y1: y, y2: y }));
      const label = svg("text", { x: PAD.left - 6, y: y + 4, class: "tick y" });
      label.textContent = formatNumber(t);
      grid.append(label);
    }
    for (const t of niceTicks(x0, x1, Math.max(2, Math.floor(pw / 90)))) {
      if (!Number.isInteger(t)) continue;
      const x = xOf(t);
      grid.append(svg("line", { x1: x, x2: x, y1: top, y2: height - PAD.bottom }));
      const label = svg("text", { x, y: height - PAD.bottom + 16, class: "tick x" });
      label.textContent = String(t);
      grid.append(label);
    }
    const axisLabel = svg("text", { x: width - PAD.right, y: height - 2, class: "tick x end" });
    axisLabel.textContent = "step";
    grid.append(axisLabel);
    root.append(grid);

    root.append(legend);

    const pathOf = (points) => {
      let d = "";
      for (const p of thin(points, pw, xOf)) {
        d += `${d ? "L" : "M"}${xOf(p.x).toFixed(1)},${yOf(p.y).toFixed(1)}`;
      }
      return d;
    };
    if (this.smoothing) {
      // The raw values, faint, under every smoothed line.
      for (const s of this.series) {
        const cls = `chart-line raw series-${s.colour}`;
        root.append(svg("path", { d: pathOf(s.raw), class: cls, "data-name": s.name }));
      }
    }
    for (const s of this.series) {
      const attrs = { d: pathOf(s.points), class: `chart-line series-${s.colour}`, "data-name": s.name };
      if (s.cls) attrs.class += ` ${s.cls}`;
      if (s.key != null) attrs["data-key"] = s.key;
      root.append(svg("path", attrs));
      const last = s.points[s.points.length - 1];
      root.append(
        svg("circle", { cx: xOf(last.x), cy: yOf(last.y), r: 3, class: `chart-dot series-${s.colour}` }),
      );
    }

    this.cursor = svg("g", { class: "chart-cursor", visibility: "hidden" });
    this.cursorLine = svg("line", { y1: top, y2: height - PAD.bottom });
    this.cursorDots = this.series.map((s) => svg("circle", { r: 4, class: `series-${s.colour}` }));
    this.cursorText = svg("text", { y: top + 12 });
    this.cursor.append(this.cursorLine, ...this.cursorDots, this.cursorText);
    root.append(this.cursor);
    this.layout = { xOf, yOf, x0, x1, pw, width };
    // A redraw for new points keeps the read-out where the mouse still is.
    if (this.hoverX != null) this.hover({ clientX: this.hoverX });
  }

  hover(ev) {
    this.hoverX = ev ? ev.clientX : null;
    if (!this.layout || !this.cursor) return;
    if (!ev) {
      this.cursor.setAttribute("visibility", "hidden");
      return;
    }
    const { xOf, yOf, x0, x1, pw, width } = this.layout;
    const rect = this.root.getBoundingClientRect();
    const step = x0 + ((ev.clientX - rect.left - PAD.left) / pw) * (x1 - x0);
    // Each series' point nearest the mouse; the line stands at the nearest of them.
    const near = this.series.map((s) => s.points[nearest(s.points, step)]);
    let at = near[0].x;
    for (const p of near) if (Math.abs(p.x - step) < Math.abs(at - step)) at = p.x;
    const x = xOf(at);
    this.cursorLine.setAttribute("x1", x);
    this.cursorLine.setAttribute("x2", x);
    near.forEach((p, i) => {
      this.cursorDots[i].setAttribute("cx", xOf(p.x));
      this.cursorDots[i].setAttribute("cy", yOf(p.y));
    });
    const right = x > width - 240;
    this.cursorText.setAttribute("x", right ? x - 6 : x + 6);
    this.cursorText.setAttribute("text-anchor", right ? "end" : "start");
    const values = this.series.map((s, i) => {
      const p = near[i];
      return `${s.name} ${formatNumber(p.y)}${p.x === at ? "" : ` (step ${p.x})`}`;
    });
    this.cursorText.textContent = `step ${at}: ${values.join(" · ")}`;
    this.cursor.setAttribute("visibility", "visible");
  }
}
