// A job's metric series over the whole run, fetched at a bounded cost and followed as it
// grows (the job page and the comparison view), and what the chart says of what it shows.

import { numberOf } from "./common.js";

// max_points of every metrics fetch: about two points per pixel of the chart's width.
export const HISTORY_POINTS = { min: 500, max: 4000, perPixel: 2 };
// While a new attempt reports again steps an earlier one reached, the job's latest step
// does not move: its metrics are then fetched again at most this often.
export const BEHIND_REFRESH_MS = 10000;

// The history's size for a chart `width` pixels wide.
export const historyPoints = (width) => {
  const { min, max, perPixel } = HISTORY_POINTS;
  return Math.min(max, Math.max(min, perPixel * width));
};

// Lowest to highest as the API ranks values (service/metrics.py): NaN above every number.
const rankBelow = (a, b) => (Number.isNaN(a) ? false : Number.isNaN(b) ? true : a < b);

// At most `maxPoints` of `pts` (sorted by x) that keep their shape, as the API
// downsamples: equal spans of steps, each keeping its lowest and highest point, and the
// first and the last point.
export function thinHistory(pts, maxPoints) {
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
export class MetricHistory {
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

// One series of a job's points (a whole answer of GET /jobs/{id}/metrics) as its latest
// attempt sees it: a resumed attempt reports again the steps from where it resumed, so
// each earlier attempt's points count only before the step a later one started at.
export function currentRun(items, name) {
  const firstOf = new Map(); // attempt -> its first step of the series
  for (const item of items) {
    if (!(name in item.values)) continue;
    const a = item.attempt ?? 0;
    if (!firstOf.has(a) || item.step < firstOf.get(a)) firstOf.set(a, item.step);
  }
  const cutOf = new Map(); // attempt -> the first step a later attempt reported
  let cut = Infinity;
  for (const a of [...firstOf.keys()].sort((x, y) => y - x)) {
    cutOf.set(a, cut);
    cut = Math.min(cut, firstOf.get(a));
  }
  const points = [];
  for (const item of items) {
    if (!(name in item.values)) continue;
    if (item.step < cutOf.get(item.attempt ?? 0)) {
      points.push({ x: item.step, y: numberOf(item.values[name]), a: item.attempt });
    }
  }
  return points;
}

export const count = (n) => n.toLocaleString("en-US");

// The note under the chart: which series drawn show fewer points than they have, and
// whether retention downsampled the job's series in storage (the chart cannot tell).
export function chartNote(history, names, job) {
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
