// What every view of the dashboard shares: building elements from data (always as text,
// never as HTML), the API with the token (asked once, kept in this browser), polling,
// and who the token is. app.js routes to the views: jobs (app.js), sweeps (sweeps.js),
// a comparison of runs (compare.js).

import { formatNumber } from "./chart.js";

export const TOKEN_KEY = "ddpq.token";
export const POLL_MS = 2000;
export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
// A job's states, and a sweep's (running, done, cancelled) and its trials' (active,
// paused, complete, pruned, failed, cancelled): each has its colour in style.css.
const STATES = new Set([
  "queued", "held", "running", "cancelling", "succeeded", "failed", "cancelled",
  "active", "paused", "complete", "pruned", "done",
]);

export const $ = (id) => document.getElementById(id);

// A table's rows, and its "none yet" line (#<id>-empty) shown only when there are none.
export function fillTable(id, rows) {
  document.querySelector(`#${id} tbody`).replaceChildren(...rows);
  const empty = $(`${id}-empty`);
  if (empty) empty.hidden = rows.length > 0;
}

export function el(tag, attrs = {}, ...children) {
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

export function statusBadge(status) {
  const known = STATES.has(status) ? status : "unknown";
  return el("span", { class: `status s-${known}` }, status);
}

export function age(iso) {
  if (!iso) return "";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

export function when(iso) {
  if (!iso) return "";
  return `${new Date(iso).toLocaleString()} (${age(iso)} ago)`;
}

// ---- the API, with the token ---------------------------------------------------------

let token = localStorage.getItem(TOKEN_KEY);
let asking = null;

export class ApiError extends Error {
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

export function forgetToken() {
  token = null;
  localStorage.removeItem(TOKEN_KEY);
  showWho(null);
}


// Who the token is (GET /whoami, once per token): the actions a page offers depend on it.
let viewer = null;
let viewerChanged = () => {}; // the open view's, to show or hide its actions again
const whoListeners = []; // the page's own, for as long as it lives (the owner filter)

export const currentViewer = () => viewer;
export function setViewerChanged(fn) {
  viewerChanged = fn;
}
export function onWho(fn) {
  whoListeners.push(fn);
}

// Who the token is: "signed in as alice (member)" in the header.
function showWho(who) {
  viewer = who;
  const w = $("whoami");
  w.textContent = who ? `signed in as ${who.name} (${who.role})` : "";
  w.hidden = !who;
  if (who) for (const fn of whoListeners) fn(who);
  viewerChanged();
}


// Ask the API who the token is (GET /whoami): when the page starts with a stored token,
// and each time a token is entered. A token that is not a user's is asked for again.
export async function checkWho() {
  const asked = token;
  try {
    const who = await api("/whoami");
    if (token === asked) showWho(who);
  } catch (e) {
    if (e.status !== 0) console.warn(e);
  }
}

// Show the token dialog; every caller waiting for a token shares one prompt.
export function askToken(message) {
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

export async function api(path, { method = "GET", raw = false } = {}) {
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
export function poll(fn) {
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



export const hasToken = () => Boolean(token);

// ---- values ------------------------------------------------------------------------------

// A value as a number: the API sends NaN and the infinities as names.
export const numberOf = (v) =>
  typeof v === "number" ? v : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : NaN;

export function cellValue(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return formatNumber(v);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

export function fact(dl, term, value) {
  if (value === null || value === undefined || value === "") return;
  dl.append(el("dt", {}, term), el("dd", {}, value));
}

