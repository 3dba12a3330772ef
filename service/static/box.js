// The box at a glance: #/queue the queued jobs in the order the claims try them, with
// their estimated starts (GET /queue); #/usage who used the hosts (GET /usage), fair
// share's turns, the quotas (GET /quotas) and the last 30 days' accounting per user
// (GET /accounting); #/workers the hosts, their GPUs and who holds each (GET /workers);
// #/audit who did what (GET /audit, admins only). Each polls while shown.

import { $, age, api, el, fillTable, poll, statusBadge } from "./common.js";

function span(seconds) {
  if (seconds == null) return "";
  const s = Math.floor(seconds);
  if (s >= 3600) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  if (s >= 60) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

const hours = (x) => (x < 100 ? x.toFixed(2) : x.toFixed(0));

function starts(q) {
  if (q.estimated_start == null) return el("span", { class: "muted", title: q.estimate }, "?");
  const wait = (Date.parse(q.estimated_start) - Date.now()) / 1000;
  const words = wait <= 1 ? "now" : `in ${span(wait)}`;
  return el("span", { title: `${q.estimated_start} ${q.estimate}` }, `${words} (${q.estimate})`);
}

function view(id, title, fn) {
  $(id).hidden = false;
  document.title = `ddpq · ${title}`;
  let stopped = false;
  const stop = poll(async () => {
    if (!stopped) await fn(() => stopped);
  });
  return () => {
    stopped = true;
    stop();
  };
}

export function queueView() {
  return view("queue-view", "queue", async (gone) => {
    const data = await api("/queue?limit=500");
    if (gone()) return;
    const s = data.scheduling;
    $("queue-rules").textContent =
      `${data.total} queued; preemption ${s.preemption}, fair-share half-life ` +
      `${span(s.fairshare_half_life_s)}, a CPU slot counts ${s.cpu_slot_weight} GPU, later ` +
      `jobs wait behind one queued over ${span(s.starvation_s)}`;
    const rows = data.items.map((q) =>
      el(
        "tr",
        { "data-job-id": q.job_id },
        el("td", { class: "num" }, q.position),
        el("td", { class: "num" }, el("a", { href: `#/jobs/${q.job_id}` }, q.job_id)),
        el("td", { class: "owner" }, q.user ?? ""),
        el("td", { class: "name" }, q.name ?? ""),
        el("td", { class: "num" }, q.priority),
        el("td", { class: "num" }, q.usage_gpu_s.toFixed(1)),
        el("td", {}, `${q.world_size} ${q.device}`),
        el("td", { class: "starts" }, starts(q)),
        el("td", { class: "reason", title: q.placed ?? "" }, q.placed ?? ""),
        el("td", { class: "reason", title: q.reason }, q.reason),
      ),
    );
    fillTable("queue", rows);
  });
}

const ACCT_EVERY_MS = 30_000; // a month of attempts added up: not on every poll

export function usageView() {
  let acct = null;
  let acctAt = 0;
  return view("usage-view", "usage", async (gone) => {
    const [usage, quotas] = await Promise.all([api("/usage"), api("/quotas")]);
    if (Date.now() - acctAt > ACCT_EVERY_MS) {
      acct = await api("/accounting?limit=1");
      acctAt = Date.now();
    }
    if (gone()) return;
    const total = usage.items.reduce((n, u) => n + u.usage_gpu_s, 0) || 1;
    const ranked = [...usage.items].sort((a, b) => a.usage_gpu_s - b.usage_gpu_s || a.user.localeCompare(b.user));
    fillTable(
      "usage",
      ranked.map((u, i) =>
        el(
          "tr",
          { "data-user": u.user },
          el("td", { class: "num" }, i + 1),
          el("td", { class: "owner" }, u.user),
          el("td", { class: "num" }, u.running),
          el("td", { class: "num" }, u.queued),
          el("td", { class: "num" }, hours(u.gpu_hours_7d)),
          el("td", { class: "num" }, hours(u.cpu_slot_hours_7d)),
          el("td", { class: "num" }, u.usage_gpu_s.toFixed(1)),
          el("td", { class: "num" }, `${((100 * u.usage_gpu_s) / total).toFixed(1)} %`),
        ),
      ),
    );
    const limit = (v) => (v == null ? "no limit" : v);
    fillTable(
      "quotas",
      quotas.items.map((q) =>
        el(
          "tr",
          { "data-user": q.user },
          el("td", { class: "owner" }, q.user === "*" ? "* (everyone's default)" : q.user),
          el("td", { class: "num" }, limit(q.max_gpus)),
          el("td", { class: "num" }, limit(q.max_running)),
          el("td", { class: "num" }, limit(q.max_queued)),
          el("td", { class: "num" }, q.max_priority ?? "0 (default)"),
        ),
      ),
    );
    fillTable(
      "acct",
      acct.totals.map((t) =>
        el(
          "tr",
          { "data-user": t.user ?? "(everyone)" },
          el("td", { class: "owner" }, t.user ?? "(everyone)"),
          el("td", { class: "num" }, t.jobs),
          el("td", { class: "num" }, t.attempts),
          el("td", { class: "num" }, span(t.elapsed_s)),
          el("td", { class: "num" }, hours(t.gpu_hours)),
          el("td", { class: "num" }, hours(t.cpu_slot_hours)),
          el("td", { class: "num" }, t.preemptions),
        ),
      ),
    );
  });
}

// A worker that stopped: leaving while its jobs are handed back, then left (a Slurm
// bridge's go on running in Slurm without it).
function leftBadge(w) {
  const words = w.running.length && !w.cluster ? "leaving" : "left";
  return el("span", { class: "status s-cancelled", title: `left ${w.left_at}` }, words);
}

export function workersView() {
  return view("workers-view", "workers", async (gone) => {
    const data = await api("/workers");
    if (gone()) return;
    const rows = data.items.map((w) => {
      const held = w.running
        .map((r) => `job ${r.job_id} (${r.owner ?? "-"}${r.gpus.length ? `: GPUs ${r.gpus.join(",")}` : ""})`)
        .join("; ");
      return el(
        "tr",
        { "data-worker": w.name },
        el("td", { class: "name" }, w.name),
        el("td", {}, w.left_at ? leftBadge(w) : statusBadge(w.alive ? "running" : "failed")),
        el("td", { class: "num" }, `${w.free_cpu_slots}/${w.cpu_slots}`),
        el("td", { class: "num" }, `${w.free_gpus.length}/${w.gpus.length}`),
        el("td", { class: "reason", title: held }, held),
        el("td", { class: "num", title: w.last_heartbeat }, age(w.last_heartbeat)),
      );
    });
    fillTable("workers", rows);
  });
}

export function auditView() {
  return view("audit-view", "audit", async (gone) => {
    let data;
    try {
      data = await api("/audit?limit=200");
    } catch (e) {
      if (e.status !== 403) throw e;
      $("audit-empty").textContent = "The audit trail is for admins.";
      fillTable("audit", []);
      return;
    }
    if (gone()) return;
    const rows = data.items.map((e) =>
      el(
        "tr",
        {},
        el("td", { class: "num", title: e.at }, age(e.at)),
        el("td", { class: "owner" }, e.actor),
        el("td", {}, e.action),
        el("td", {}, e.target),
        el("td", { class: "reason" }, e.detail == null ? "" : JSON.stringify(e.detail)),
      ),
    );
    fillTable("audit", rows);
  });
}
