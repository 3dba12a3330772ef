"""The web dashboard in a real browser: Playwright driving Debian's Chromium.

A real `ddpq serve` on SQLite (the page is what is tested, not the database); the test
plays the worker and the rank by hand over the worker protocol (tests/helpers.py), so
it needs no torchrun: it reports a loss every few tenths of a second, appends log
lines, registers a checkpoint, and stops when a heartbeat tells it the job was
cancelled, exactly as the worker does.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from sqlalchemy import update

from service.db import Database
from service.models import Job
from tests.conftest import Server, _sqlite_copy, start_server, stop_server, wait_for
from tests.helpers import finish, register, report, submit_and_claim

CHROMIUM = os.environ.get("DDPQ_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 20_000  # the machine is shared: generous, but every wait is on a condition
STATIC = [
    "app.js",
    "common.js",
    "history.js",
    "gpus.js",
    "chart.js",
    "scatter.js",
    "sweeps.js",
    "compare.js",
    "box.js",
    "style.css",
    "favicon.svg",
    "index.html",
]


@pytest.fixture
def sqlite_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    s = start_server(_sqlite_copy(request, tmp_path / "ddpq.db"), tmp_path / "api")
    yield s
    stop_server(s)


def test_the_shell_is_open_holds_no_data_and_the_data_needs_the_token(
    sqlite_server: Server,
) -> None:
    server = sqlite_server
    secret_name = "secret-project-name-7f3a"
    r = server.client().post("/jobs", json={"recipe": "toy-regression", "name": secret_name})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    anon = server.client(token=None)
    pages = {"/": anon.get("/"), **{f"/static/{n}": anon.get(f"/static/{n}") for n in STATIC}}
    for path, resp in pages.items():
        assert resp.status_code == 200, (path, resp.text)
        assert secret_name not in resp.text, path
        csp = resp.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, csp
        assert resp.headers["x-content-type-options"] == "nosniff"
        assert resp.headers["referrer-policy"] == "no-referrer"
        assert "no-cache" in resp.headers["cache-control"]
    assert pages["/"].headers["content-type"].startswith("text/html")
    assert pages["/static/app.js"].headers["content-type"].startswith("text/javascript")
    assert pages["/static/style.css"].headers["content-type"].startswith("text/css")
    # Nothing outside the page's own origin is loaded: it works offline.
    for path in ("/", *(f"/static/{n}" for n in STATIC if n.endswith((".js", ".css")))):
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", pages[path].text), path

    etag = pages["/static/app.js"].headers["etag"]
    again = anon.get("/static/app.js", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    head = anon.head("/")
    assert head.status_code == 200 and head.content == b""

    # Only the shipped files, by exact name: no traversal, no other file of the package.
    for path in (
        "/static/nope.js",
        "/static/..%2fapp.py",
        "/static/%2e%2e%2f%2e%2e%2fpyproject.toml",
        "/static/../routes/ui.py",
        "/static/",
        "/static/.",
        "/static/index.html/",
    ):
        resp = httpx.get(server.url + path, timeout=10)  # raw: httpx must not tidy the path
        assert resp.status_code in (404, 307), (path, resp.status_code)
        assert "ASSETS" not in resp.text and "[project]" not in resp.text, path

    # The data stays behind the token.
    for path in (
        "/jobs",
        f"/jobs/{job_id}",
        f"/jobs/{job_id}/metrics",
        f"/jobs/{job_id}/logs",
        "/sweeps",
        "/sweeps/1",
        "/sweeps/1/export",
    ):
        assert anon.get(path).status_code == 401, path
        assert server.client("bogus").get(path).status_code == 401, path
    assert anon.post(f"/jobs/{job_id}/cancel").status_code == 401
    assert server.client().get(f"/jobs/{job_id}").json()["status"] == "queued"


def _console(message: Any, problems: list[str]) -> None:
    if message.type != "error":
        return
    problems.append(f"{message.text} ({message.location.get('url')})")


def _screenshot(page: Any, name: str) -> None:
    """For a person to look at: DDPQ_SCREENSHOT_DIR=/tmp/shots pytest tests/test_dashboard.py"""
    folder = os.environ.get("DDPQ_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


class HandWorker:
    """The worker and rank 0 of one claimed attempt, driven by hand on a thread."""

    def __init__(self, server: Server, claim: dict[str, Any], name: str) -> None:
        self.server = server
        self.claim = claim
        self.name = name
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hand-worker", daemon=True)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # surfaced by the test, not lost on the thread
            self.error = exc

    def _loop(self) -> None:
        job_id, attempt = self.claim["job_id"], self.claim["attempt"]
        rank = self.server.client(self.claim["token"])
        worker = self.server.client("worker")
        log_offset = 0
        step = 0
        while not self.stop.is_set():
            step += 1
            loss = 2.0 / (1 + 0.3 * step)
            r = rank.post(
                f"/jobs/{job_id}/metrics",
                json={
                    "items": [
                        {
                            "step": step,
                            "epoch": step / 10,
                            "values": {"loss": loss, "lr": 0.9**step},
                            # The job's, sent once: the progress bar's end.
                            **({"total_steps": 500} if step == 1 else {}),
                        }
                    ]
                },
            )
            assert r.status_code == 202, r.text
            line = f"[rank0] step {step} loss {loss:.4f} <b>not html</b>\n".encode()
            r = worker.post(
                f"/workers/jobs/{job_id}/logs",
                params={"worker": self.name, "attempt": attempt, "offset": log_offset},
                content=line,
            )
            assert r.status_code == 202, r.text
            log_offset += len(line)
            if step == 3:
                r = rank.post(
                    f"/jobs/{job_id}/checkpoints",
                    json={
                        "path": f"{self.claim['checkpoint_dir']}/step3.pt",
                        "step": 3,
                        "metrics": {"loss": loss},
                    },
                )
                assert r.status_code == 201, r.text
            beat = worker.post(
                "/workers/heartbeat",
                json={"name": self.name, "running": [{"job_id": job_id, "attempt": attempt}]},
            )
            assert beat.status_code == 200, beat.text
            if any(c["job_id"] == job_id for c in beat.json()["cancel"]):
                r = worker.post(
                    f"/workers/jobs/{job_id}/finish",
                    json={
                        "worker": self.name,
                        "attempt": attempt,
                        "exit_code": -15,
                        "outcome": "cancelled",
                    },
                )
                assert r.status_code == 200, r.text
                self.finished.set()
                return
            self.stop.wait(0.4)


def test_dashboard_follows_a_job_and_cancels_it(sqlite_server: Server) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (or set DDPQ_CHROMIUM)")
    expect.set_options(timeout=TIMEOUT_MS)
    server = sqlite_server
    api = server.client()
    worker_name = "hand"
    register(server, worker_name)
    r = api.post("/jobs", json={"entrypoint": "train.py", "name": "dash <i>job</i>"})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    hand: HandWorker | None = None
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context()
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            # CSP violations and script errors show up here.
            page.on("console", lambda m: _console(m, problems))
            page.on("pageerror", lambda e: problems.append(str(e)))
            offsite: list[str] = []
            page.on(
                "request",
                lambda req: None if req.url.startswith(server.url) else offsite.append(req.url),
            )

            page.goto(server.url + "/")
            login = page.locator("#login")
            expect(login).to_be_visible()
            page.fill("#token-input", "not-the-token")
            page.click("#login button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("refused")
            page.fill("#token-input", server.api_token)
            page.click("#login button[type=submit]")
            expect(login).to_be_hidden()
            # Who the token is (GET /whoami): the API's own token is the first admin's.
            expect(page.locator("#whoami")).to_have_text("signed in as admin (admin)")
            problems.clear()  # the refused token's 401 is logged by the browser, on purpose

            row = page.locator(f'#jobs tr[data-job-id="{job_id}"]')
            # The name is shown as text, not parsed as markup.
            expect(row.locator("td.name")).to_have_text("dash <i>job</i>")
            expect(row.locator("td.owner")).to_have_text("admin")
            expect(row.locator(".status")).to_have_text("queued")

            claim_r = server.client("worker").post(
                "/workers/claim",
                json={"name": worker_name, "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5},
            )
            assert claim_r.status_code == 200, claim_r.text
            claim = claim_r.json()
            assert claim["job_id"] == job_id
            hand = HandWorker(server, claim, worker_name)
            hand.thread.start()

            # The table refreshes by itself: status and latest loss arrive without a reload.
            expect(row.locator(".status")).to_have_text("running")
            expect(row.locator("td.loss")).to_have_text(re.compile(r"\d"))
            _screenshot(page, "jobs")
            row.locator("td.name a").click()
            expect(page).to_have_url(re.compile(rf"#/jobs/{job_id}$"))

            expect(page.locator("#job-status .status")).to_have_text("running")
            expect(page.locator("#job-facts")).to_contain_text(worker_name)
            chart = page.locator("#chart")
            expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))
            first = int(chart.get_attribute("data-points") or 0)
            expect(chart).not_to_have_attribute("data-points", str(first))
            assert int(chart.get_attribute("data-points") or 0) > first
            expect(chart.locator("path.chart-line")).to_have_count(1)  # the loss, at first
            expect(page.locator("#job-facts")).to_contain_text(re.compile(r"step \d+ of 500"))
            # Another series on the same chart, each its own colour, named in the legend;
            # then on a log scale: the chart redraws from the points it holds.
            expect(page.locator("#metric-list input")).to_have_count(2)
            page.check('#metric-list input[value="lr"]')
            expect(chart.locator("path.chart-line")).to_have_count(2)
            expect(chart.locator(".chart-legend-item")).to_have_text(["loss", "lr"])
            colours = {
                chart.locator(f'path.chart-line[data-name="{n}"]').get_attribute("class")
                for n in ("loss", "lr")
            }
            assert len(colours) == 2, colours
            page.check("#log-scale")
            expect(chart.locator("svg")).to_have_attribute("aria-label", re.compile(r"^loss, lr: "))
            page.uncheck('#metric-list input[value="loss"]')
            expect(chart.locator("svg")).to_have_attribute("aria-label", re.compile(r"^lr: "))
            expect(chart.locator("path.chart-line")).to_have_count(1)
            _screenshot(page, "job-lr-log")
            page.check('#metric-list input[value="loss"]')
            page.uncheck('#metric-list input[value="lr"]')
            page.uncheck("#log-scale")
            expect(chart.locator("svg")).to_have_attribute("aria-label", re.compile(r"^loss: "))
            # Smoothed (an EMA, as the comparison's), then raw again.
            page.locator("#smoothing").fill("0.8")
            expect(page.locator("#smoothing-value")).to_have_text("0.80")
            expect(chart).to_have_attribute("data-smoothing", "0.8")
            page.locator("#smoothing").fill("0")
            expect(chart).to_have_attribute("data-smoothing", "0")
            expect(page.locator("#log")).to_contain_text("[rank0] step 2 loss")
            expect(page.locator("#log")).to_contain_text("<b>not html</b>")
            expect(page.locator("#checkpoints tbody")).to_contain_text("step3.pt")
            expect(page.locator("#attempts tbody tr")).to_have_count(1)
            expect(page.locator("#attempts tbody")).to_contain_text(worker_name)

            _screenshot(page, "job-running")
            page.once("dialog", lambda d: d.accept())
            page.click("#cancel")
            expect(page.locator("#job-status .status")).to_have_text(
                re.compile(r"^(cancelling|cancelled)$")
            )
            expect(page.locator("#job-status .status")).to_have_text("cancelled")
            expect(page.locator("#cancel")).to_be_disabled()
            _screenshot(page, "job-cancelled")
            assert hand.finished.wait(10), "the hand worker did not report the cancel"
            assert api.get(f"/jobs/{job_id}").json()["status"] == "cancelled"

            # The token is kept in the browser: a reload asks nothing.
            stored = [
                item["value"]
                for origin in context.storage_state()["origins"]
                for item in origin["localStorage"]
                if item["name"] == "ddpq.token"
            ]
            assert stored == [server.api_token]
            page.reload()
            expect(page.locator("#job-status .status")).to_have_text("cancelled")
            expect(login).to_be_hidden()
            expect(page.locator("#whoami")).to_have_text("signed in as admin (admin)")
            page.click("#forget")
            expect(login).to_be_visible()
            expect(page.locator("#whoami")).to_be_hidden()
            assert not any(
                item["name"] == "ddpq.token"
                for origin in context.storage_state()["origins"]
                for item in origin["localStorage"]
            )
            assert not problems, problems
            assert not offsite, offsite
        finally:
            if hand is not None:
                hand.stop.set()
                hand.thread.join(10)
            browser.close()
    assert hand is not None and hand.error is None, hand.error if hand else None
    assert not hand.thread.is_alive(), "the hand worker did not stop"


def _loss(step: int) -> float:
    """High at the first step, then low and slowly falling: a chart of only the newest
    points would never reach 4."""
    return 4.0 if step == 1 else 1.0 + 1.0 / step


def test_the_chart_draws_the_whole_run_of_several_series_and_follows_it(
    sqlite_server: Server, tmp_path: Path
) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (or set DDPQ_CHROMIUM)")
    expect.set_options(timeout=TIMEOUT_MS)
    server = sqlite_server
    claim = submit_and_claim(server, name="hand")
    job_id = claim["job_id"]

    def points(first: int, last: int) -> list[dict[str, Any]]:
        return [
            {
                "step": s,
                "values": {
                    "loss": _loss(s),
                    **({"val_loss": 2.0 - s / 10_000} if s % 500 == 0 else {}),
                },
            }
            for s in range(first, last + 1)
        ]

    # An older ddpq.train sends total_steps among the values: the job's, never a series.
    report(server, claim, [{"step": 1, "values": {"loss": _loss(1), "total_steps": 6000.0}}])
    report(server, claim, points(2, 6000))
    asked: list[str] = []
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("console", lambda m: _console(m, problems))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: asked.append(r.url) if "/metrics" in r.url else None)
            page.goto(f"{server.url}/#/jobs/{job_id}")
            page.fill("#token-input", server.api_token)
            page.click("#login button[type=submit]")

            chart = page.locator("#chart")
            # The series offered are the metrics: total_steps is the job's progress.
            expect(page.locator("#metric-list input")).to_have_count(2)
            names = page.locator("#metric-list input").evaluate_all("l => l.map(i => i.value)")
            assert names == ["loss", "val_loss"], names
            expect(page.locator("#job-facts")).to_contain_text("step 6000 of 6000 (100%)")
            # loss and val_loss share the chart at first, over the whole run: from the
            # first step (its point, 4.0, is the highest) to the last.
            expect(chart.locator("path.chart-line")).to_have_count(2)
            expect(chart).to_have_attribute("data-first-step", "1")
            expect(chart).to_have_attribute("data-last-step", "6000")
            expect(page.locator("#chart-info")).to_contain_text("steps 1 to 6000")
            expect(chart.locator(".tick.y").last).to_have_text(re.compile(r"^4(\.0*)?$"))
            # Downsampled by the API: fewer points than the run has, the shape kept.
            drawn = int(chart.get_attribute("data-points") or 0)
            assert 100 < drawn < 6000, drawn
            # ... and said under the chart, for the long series only (val_loss: 12 points).
            note = page.locator("#chart-note")
            expect(note).to_be_visible()
            expect(note).to_have_text(
                re.compile(r"^loss: [1-9][\d,]* of 6,000 points shown \(downsampled\)$")
            )
            loss_shown = int(note.inner_text().split()[1].replace(",", ""))
            assert loss_shown < 6000 and loss_shown + 12 == drawn, (loss_shown, drawn)
            _screenshot(page, "whole-run")
            page.locator('#metric-list input[value="loss"]').uncheck()
            expect(chart.locator("path.chart-line")).to_have_count(1)
            expect(note).to_be_hidden()  # val_loss alone: every point shown
            page.locator('#metric-list input[value="loss"]').check()
            expect(note).to_contain_text("of 6,000 points shown")

            # Retention downsampled the job's series in storage: said too (the job says
            # how many points it removed; here set by hand, the job still running).
            db = Database(f"sqlite:///{tmp_path / 'ddpq.db'}")
            with db.write() as s:
                s.execute(update(Job).where(Job.id == job_id).values(metrics_thinned=1234))
            db.dispose()
            # Live: what the running job reports next is drawn, asked for alone; the
            # count of points held follows (6,000 + 500 new).
            report(server, claim, points(6001, 6500))
            expect(chart).to_have_attribute("data-last-step", "6500")
            expect(chart).to_have_attribute("data-first-step", "1")
            expect(page.locator("#chart-info")).to_contain_text("val_loss 1.35 at step 6500")
            expect(note).to_contain_text("of 6,500 points shown (downsampled)")
            expect(note).to_contain_text("in storage after it ended: 1,234 points removed")
            assert "val_loss:" not in note.inner_text()
            assert not problems, problems
        finally:
            browser.close()
    # Every fetch is bounded: the whole run once, then only what is new since.
    queries = [httpx.URL(u).params for u in asked]
    assert queries and all("max_points" in q for q in queries), asked
    assert "since_step" not in queries[0] and all("since_step" in q for q in queries[1:]), asked
    finish(server, claim)


def test_a_member_sees_who_they_are_filters_by_owner_and_cancels_only_their_own(
    sqlite_server: Server,
) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (or set DDPQ_CHROMIUM)")
    expect.set_options(timeout=TIMEOUT_MS)
    server = sqlite_server
    admin = server.client()
    r = admin.post("/users", json={"name": "alice", "role": "member"})
    assert r.status_code == 201, r.text
    alice = server.client(r.json()["token"])
    theirs = admin.post("/jobs", json={"recipe": "toy-regression", "name": "admins"}).json()
    mine = alice.post("/jobs", json={"recipe": "toy-regression", "name": "alices"}).json()
    r_bob = admin.post("/users", json={"name": "bob", "role": "member"})
    bob = server.client(r_bob.json()["token"])
    bobs = bob.post("/jobs", json={"recipe": "toy-regression", "name": "bobs"}).json()
    problems: list[str] = []
    asked: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda q: asked.append(q.url) if "/jobs?" in q.url else None)
            page.goto(server.url + "/")
            # A worker's token is a token, but not a user's: asked again.
            page.fill("#token-input", server.worker_token)
            page.click("#login button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("refused")
            page.fill("#token-input", r.json()["token"])
            page.click("#login button[type=submit]")
            expect(page.locator("#login")).to_be_hidden()
            expect(page.locator("#whoami")).to_have_text("signed in as alice (member)")

            rows = page.locator("#jobs tbody tr")
            owners = page.locator("#jobs td.owner")
            expect(owners).to_have_text(["bob", "alice", "admin"])
            # The owner filter: everyone, and each user the page has met, in order.
            choices = page.locator("#owner-filter option")
            expect(choices).to_have_text(["everyone", "admin", "alice", "bob"])
            page.select_option("#owner-filter", "bob")
            expect(owners).to_have_text(["bob"])
            expect(rows.first).to_have_attribute("data-job-id", str(bobs["id"]))
            page.select_option("#owner-filter", "admin")
            expect(owners).to_have_text(["admin"])
            # Filtered by the API, as `ddpq ls --user` is: not in the page.
            assert any("user=bob" in u for u in asked) and any("user=admin" in u for u in asked)
            page.select_option("#owner-filter", "alice")
            expect(owners).to_have_text(["alice"])
            page.select_option("#owner-filter", "")
            expect(rows).to_have_count(3)

            # Another's job: no Cancel offered (the API would refuse it: 403).
            cancel = page.locator("#cancel")
            page.goto(f"{server.url}/#/jobs/{theirs['id']}")
            expect(page.locator("#job-facts")).to_contain_text("admin")
            expect(page.locator("#job-status .status")).to_have_text("queued")
            expect(cancel).to_be_hidden()
            # Their own (the same page, another job: no reload): offered, and it works.
            page.goto(f"{server.url}/#/jobs/{mine['id']}")
            expect(page.locator("#job-title")).to_contain_text("alices")
            expect(cancel).to_be_visible()
            page.once("dialog", lambda d: d.accept())
            cancel.click()
            expect(page.locator("#job-status .status")).to_have_text("cancelled")
            expect(cancel).to_be_disabled()
            assert admin.get(f"/jobs/{theirs['id']}").json()["status"] == "queued"
            assert not problems, problems

            # Revoked while the page polls: the next answer is a 401, and the page says
            # why and asks for a token instead of asking the API again and again.
            assert admin.post("/users/alice/revoke").status_code == 200
            page.goto(f"{server.url}/#/")
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#login-error")).to_contain_text("refused the token")
            expect(page.locator("#login-error")).to_contain_text("revoked")
            expect(page.locator("#whoami")).to_be_hidden()
        finally:
            browser.close()
    assert alice.get("/whoami").status_code == 401
    assert admin.post(f"/jobs/{theirs['id']}/cancel").json()["status"] == "cancelled"
    assert bob.post(f"/jobs/{bobs['id']}/cancel").json()["status"] == "cancelled"


# ---- sweeps and runs compared ----------------------------------------------------------

STATIC_DIR = Path(__file__).resolve().parent.parent / "service" / "static"
# Ways a script could put data into the page as markup: none of them is used.
AS_HTML = re.compile(
    r"\.(innerHTML|outerHTML)\b|insertAdjacentHTML|document\.write|createContextualFragment"
    r"|DOMParser|\beval\(|new Function\("
)


def test_the_pages_put_data_in_as_text_only() -> None:
    """Every script builds the page from elements and text nodes (el(), textContent,
    setAttribute): data the API sends is never parsed as HTML, in any view."""
    scripts = sorted(STATIC_DIR.glob("*.js"))
    assert {p.name for p in scripts} == {n for n in STATIC if n.endswith(".js")}
    for path in scripts:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not AS_HTML.search(line), f"{path.name}:{number}: {line.strip()}"


@pytest.fixture
def sweep_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    # The sweeper's round every 0.5 s (a third of the gang timeout): a sweep decides at once.
    s = start_server(
        _sqlite_copy(request, tmp_path / "ddpq.db"), tmp_path / "api", DDPQ_GANG_TIMEOUT_S="1.5"
    )
    yield s
    stop_server(s)


def _browser_page(p: Any, server: Server, problems: list[str], path: str) -> tuple[Any, Any]:
    """A browser on ``path`` of the dashboard, signed in with the API's token; script
    errors and CSP violations go to ``problems``."""
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(TIMEOUT_MS)
    page.on("console", lambda m: _console(m, problems))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(server.url + path)
    page.fill("#token-input", server.api_token)
    page.click("#login button[type=submit]")
    expect(page.locator("#login")).to_be_hidden()
    return browser, page


def _claim(server: Server, worker: str = "hand") -> dict[str, Any]:
    register(server, worker, cpu_slots=16)
    r = server.client("worker").post(
        "/workers/claim",
        json={"name": worker, "free_cpu_slots": 16, "free_gpus": [], "wait_s": 0},
    )
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else {}


def _run(server: Server, **spec: Any) -> dict[str, Any]:
    """A job submitted with ``spec`` (its name too) and claimed by the hand worker."""
    r = server.client().post("/jobs", json={"entrypoint": "train.py", **spec})
    assert r.status_code == 201, r.text
    claim = _claim(server)
    assert claim["job_id"] == r.json()["id"], claim
    return claim


def _trial_loss(base: float, step: int) -> float:
    return base * (1 + 1 / step)


def test_a_sweep_page_ranks_its_trials_plots_them_and_exports_them(
    sweep_server: Server,
) -> None:
    """Four trials under ASHA (a rung at step 5, half kept): the two worst are pruned, one
    completes, one still runs. The sweeps list links to the sweep; its page ranks the
    trials as GET /sweeps/N does, puts a mark per trial on the parameter's axis (log for
    a log-uniform one, discrete for a categorical), overlays their curves, and exports
    the table as the API writes it."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (or set DDPQ_CHROMIUM)")
    expect.set_options(timeout=TIMEOUT_MS)
    server = sweep_server
    api = server.client()
    body = {
        "name": "lr <b>sweep</b>",
        "job": {"entrypoint": "train.py", "args": ["--lr", "{lr}", "--act", "{act}"]},
        "space": {
            "lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
            "act": {"type": "categorical", "values": ["relu", "gelu", "<i>tanh</i>"]},
            "width": {"type": "fixed", "value": 64},
        },
        "method": "random",
        "metric": "loss",
        "max_trials": 4,
        "max_concurrent": 4,
        "seed": 7,
        "early_stopping": {"type": "asha", "min_steps": 5, "reduction_factor": 2},
    }
    r = api.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    claims: dict[int, dict[str, Any]] = {}
    while len(claims) < 4:
        c = wait_for(lambda: _claim(server), 30, "a trial to claim")
        claims[int(c["spec"]["name"].rsplit("/", 1)[1])] = c
    # Each trial reports steps 1 to 5 in turn: the rung at step 5 keeps the better half
    # of those that reached it so far (the first to reach it, 1, goes on; 0 is better
    # than 1; 2 and 3 are worse than both).
    bases = {1: 0.8, 0: 0.5, 2: 3.0, 3: 6.0}
    for n, base in bases.items():
        report(server, claims[n], [{"step": s, "values": {"loss": _trial_loss(base, s)}}
                                   for s in range(1, 6)])  # fmt: skip

    def decided() -> dict[str, Any] | None:
        s: dict[str, Any] = api.get(f"/sweeps/{sweep_id}").json()
        return s if all(len(t["rungs"]) == 1 for t in s["trials"]) else None

    sweep = wait_for(decided, 30, "the sweep to decide every trial at step 5")
    pruned = {t["number"] for t in sweep["trials"] if t["state"] == "pruned"}
    kept = sorted(set(bases) - pruned)
    assert pruned and kept[:2] == [0, 1], sweep["trials"]
    # The pruned ones stop as a cancel does; the best completes; the others run on.
    held = [{"job_id": c["job_id"], "attempt": c["attempt"]} for c in claims.values()]
    beat = server.client("worker").post(
        "/workers/heartbeat", json={"name": "hand", "running": held}
    )
    assert beat.status_code == 200, beat.text
    assert sorted(x["job_id"] for x in beat.json()["cancel"]) == sorted(
        claims[n]["job_id"] for n in pruned
    )
    for n in sorted(pruned):
        r = server.client("worker").post(
            f"/workers/jobs/{claims[n]['job_id']}/finish",
            json={
                "worker": "hand",
                "attempt": claims[n]["attempt"],
                "exit_code": None,
                "outcome": "cancelled",
            },
        )
        assert r.status_code == 200, r.text
    report(server, claims[0], [{"step": s, "values": {"loss": _trial_loss(0.5, s)}}
                               for s in range(6, 11)])  # fmt: skip
    finish(server, claims[0])
    for n in kept[1:]:
        report(server, claims[n], [{"step": 6, "values": {"loss": _trial_loss(bases[n], 6)}}])

    def settled() -> dict[str, Any] | None:
        s: dict[str, Any] = api.get(f"/sweeps/{sweep_id}").json()
        states = {t["number"]: t["state"] for t in s["trials"]}
        done = states[0] == "complete" and all(states[n] == "pruned" for n in pruned)
        return (
            s
            if done and all(t["latest_step"] == 6 for t in s["trials"] if t["number"] in kept[1:])
            else None
        )

    sweep = wait_for(settled, 30, "the best trial to complete and the pruned ones to end")
    ranked = [t["number"] for t in sweep["trials"]]
    problems: list[str] = []
    with sync_playwright() as p:
        browser, page = _browser_page(p, server, problems, "/")
        try:
            # From the jobs page to the sweeps, to the sweep.
            page.click("#nav-sweeps")
            expect(page).to_have_url(re.compile(r"#/sweeps$"))
            row = page.locator(f'#sweeps tr[data-sweep-id="{sweep_id}"]')
            expect(row.locator("td.name")).to_have_text("lr <b>sweep</b>")  # as text
            expect(row).to_contain_text(f"loss 0.55 (trial 0, job {claims[0]['job_id']})")
            row.locator("td.name a").click()
            expect(page).to_have_url(re.compile(rf"#/sweeps/{sweep_id}$"))

            facts = page.locator("#sweep-facts")
            expect(facts).to_contain_text("random (seed 7)")
            expect(facts).to_contain_text("minimize loss")
            expect(facts).to_contain_text("asha: min_steps 5, reduction_factor 2")
            expect(facts).to_contain_text("4 of 4, 4 at once")
            expect(page.locator("#sweep-title")).to_have_text(f"Sweep {sweep_id} · lr <b>sweep</b>")
            # The trials in the API's order, the rank of the complete one, each job linked.
            rows = page.locator("#trials tbody tr")
            expect(rows).to_have_count(4)
            shown = rows.evaluate_all("rs => rs.map(r => Number(r.dataset.trial))")
            assert shown == ranked, (shown, ranked)
            expect(page.locator("#trials thead th")).to_have_text(
                [
                    "",
                    "rank",
                    "trial",
                    "job",
                    "state",
                    "loss",
                    "step",
                    "lr",
                    "act",
                    "width",
                    "reason",
                ]
            )
            first = page.locator('#trials tr[data-trial="0"]')
            expect(first.locator("td.rank")).to_have_text("1")
            expect(first.locator(f'a[href="#/jobs/{claims[0]["job_id"]}"]')).to_have_count(1)
            for n in pruned:
                expect(page.locator(f'#trials tr[data-trial="{n}"] .status')).to_have_text("pruned")
            for n in kept[1:]:
                expect(page.locator(f'#trials tr[data-trial="{n}"] td.value')).to_have_text(
                    re.compile(r"…$")
                )
            assert page.locator("#sweep-view i, #sweep-view b").count() == 0

            # A mark per trial: lr on a log axis, pruned trials drawn apart.
            scatter = page.locator("#scatter")
            expect(scatter).to_have_attribute("data-marks", "4")
            expect(scatter).to_have_attribute("data-x-scale", "log")
            expect(scatter.locator(".scatter-mark")).to_have_count(4)
            expect(scatter.locator(".scatter-mark.pruned")).to_have_count(len(pruned))
            expect(scatter.locator(".scatter-mark.pruned path")).to_have_count(len(pruned))
            expect(scatter.locator(".scatter-mark.best")).to_have_count(1)
            expect(scatter.locator('.scatter-mark.best[data-key="0"]')).to_have_count(1)
            # The curves: every trial's loss, the pruned ones dashed.
            curves = page.locator("#sweep-chart")
            expect(curves.locator("path.chart-line")).to_have_count(4)
            expect(curves.locator("path.chart-line.dashed")).to_have_count(len(pruned))
            expect(curves).to_have_attribute("data-last-step", "10")
            _screenshot(page, "sweep")
            page.select_option("#scatter-param", "act")
            expect(scatter).to_have_attribute("data-x-scale", "category")
            expect(scatter.locator(".scatter-mark")).to_have_count(4)
            expect(scatter.locator(".tick.x").first).to_have_text("relu")
            expect(scatter.locator(".tick.x").nth(2)).to_have_text("<i>tanh</i>")
            page.check("#sweep-log")
            expect(scatter).to_have_attribute("data-log-y", "true")
            expect(curves).to_have_attribute("data-log-y", "true")

            # Two trials chosen: their curves only, and a comparison of their jobs.
            page.check('#trials tr[data-trial="0"] td.pick input')
            page.check(f'#trials tr[data-trial="{kept[1]}"] td.pick input')
            expect(curves.locator("path.chart-line")).to_have_count(2)
            compare = page.locator("#sweep-compare")
            expect(compare).to_have_attribute(
                "href", f"#/compare?jobs={claims[0]['job_id']},{claims[kept[1]]['job_id']}"
            )

            # The CSV, fetched with the token: what the API exports.
            with page.expect_download() as download:
                page.click("#sweep-export")
            saved = Path(download.value.path()).read_text()
            assert download.value.suggested_filename == f"sweep-{sweep_id}.csv"
            assert saved == api.get(f"/sweeps/{sweep_id}/export?format=csv").text
            assert saved.splitlines()[0].startswith("rank,trial,job,state,status,loss,step")
            assert not problems, problems
        finally:
            browser.close()


def _points(first: int, last: int, scale: float, **more: float) -> list[Any]:
    """Loss falling from about 10 * scale to scale / 2 over the steps: the runs span
    decades, as a log scale shows them."""
    return [
        {
            "step": s,
            "values": {
                "loss": scale * (0.5 + 10 * 0.8**s) * (1.1 if s % 2 else 0.9),
                **{k: v * s for k, v in more.items()},
            },
        }
        for s in range(first, last + 1)
    ]


def test_runs_compared_on_one_chart_smoothed_on_a_log_scale(sqlite_server: Server) -> None:
    """Three jobs, one still running: two ticked in the jobs table open the comparison
    of those two; the comparison of all three draws a series per job named by it, a
    table of their last and best values and a trial's params, follows the running one,
    smooths (the drawn path changes, the raw one stays faint under it), and switches to
    a log scale and to a metric only one job has."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make browser` (or set DDPQ_CHROMIUM)")
    expect.set_options(timeout=TIMEOUT_MS)
    server = sqlite_server
    a = _run(server, name="base <b>run</b>")
    b = _run(server, name="wide", params={"lr": 0.01})
    c = _run(server, name="small")
    report(server, a, _points(1, 40, 0.01, acc=0.02))
    report(server, b, _points(1, 30, 1.0))
    report(server, c, _points(1, 40, 0.1))
    finish(server, a)
    finish(server, c)
    ids = [a["job_id"], b["job_id"], c["job_id"]]
    problems: list[str] = []
    with sync_playwright() as p:
        browser, page = _browser_page(p, server, problems, "/")
        try:
            # Two rows ticked in the jobs table, then Compare: the view of those two.
            button = page.locator("#compare-jobs")
            expect(page.locator("#jobs tbody tr")).to_have_count(3)
            expect(button).to_be_disabled()
            page.check(f'#jobs tr[data-job-id="{ids[2]}"] td.pick input')
            page.check(f'#jobs tr[data-job-id="{ids[0]}"] td.pick input')
            expect(button).to_have_text("Compare 2 jobs")
            button.click()
            expect(page).to_have_url(re.compile(rf"#/compare\?jobs={ids[0]},{ids[2]}$"))
            chart = page.locator("#compare-chart")
            expect(chart.locator("path.chart-line")).to_have_count(2)
            expect(page.locator("#compare-table tbody tr")).to_have_count(2)

            page.goto(f"{server.url}/#/compare?jobs={','.join(map(str, ids))}")
            lines = chart.locator("path.chart-line:not(.raw)")
            expect(lines).to_have_count(3)
            expect(chart).to_have_attribute("data-series", "3")
            expect(chart.locator(".chart-legend-item")).to_have_text(
                [f"{ids[0]} · base <b>run</b>", f"{ids[1]} · wide", f"{ids[2]} · small"]
            )
            colours = {lines.nth(i).get_attribute("class") for i in range(3)}
            assert len(colours) == 3, colours
            expect(page.locator("#compare-metric")).to_have_value("loss")
            table = page.locator("#compare-table")
            expect(table.locator("thead th")).to_have_text(
                [
                    "job",
                    "name",
                    "state",
                    "last loss",
                    "step",
                    "best (lowest)",
                    "at step",
                    "points",
                    "lr",
                ]
            )
            row_b = table.locator(f'tr[data-job-id="{ids[1]}"]')
            expect(row_b.locator(".status")).to_have_text("running")
            expect(row_b.locator("td.param")).to_have_text("0.01")
            expect(row_b.locator("td").nth(4)).to_have_text("30")
            row_a = table.locator(f'tr[data-job-id="{ids[0]}"]')
            expect(row_a.locator("td.name")).to_have_text("base <b>run</b>")
            expect(row_a.locator(".status")).to_have_text("succeeded")
            lowest = min(pt["values"]["loss"] for pt in _points(1, 40, 0.01))
            expect(row_a.locator("td.best")).to_have_text(_js_number(lowest))
            assert page.locator("#compare-view b").count() == 0

            # The running job is followed: what it reports next is drawn.
            report(server, b, _points(31, 45, 1.0))
            expect(row_b.locator("td").nth(4)).to_have_text("45")
            expect(chart).to_have_attribute("data-last-step", "45")

            # Smoothing: the line drawn changes; the raw one is drawn faint under it.
            before = lines.nth(1).get_attribute("d")
            expect(chart.locator("path.chart-line.raw")).to_have_count(0)
            page.locator("#compare-smoothing").fill("0.9")
            expect(page.locator("#compare-smoothing-value")).to_have_text("0.90")
            expect(chart).to_have_attribute("data-smoothing", "0.9")
            expect(chart.locator("path.chart-line.raw")).to_have_count(3)
            expect(lines.nth(1)).not_to_have_attribute("d", before or "")

            # A log scale: the axis changes to powers of ten (the runs span three decades).
            ticks = chart.locator(".tick.y")
            linear = ticks.all_text_contents()
            page.check("#compare-log")
            expect(chart).to_have_attribute("data-log-y", "true")
            expect(ticks).not_to_have_text(linear)
            logged = ticks.all_text_contents()
            assert {"0.01", "0.1", "1", "10"} <= set(logged), logged
            _screenshot(page, "compare")

            # A metric only one job has: one series, said which jobs lack it.
            page.select_option("#compare-metric", "acc")
            expect(lines).to_have_count(1)
            expect(page.locator("#compare-best")).to_have_value("max")
            expect(page.locator("#compare-info")).to_contain_text(
                f"not reported by {ids[1]}, {ids[2]}"
            )
            expect(row_a.locator("td.best")).to_have_text("0.8")

            assert not problems, problems

            # A job that does not exist is said, the others still drawn.
            page.goto(f"{server.url}/#/compare?jobs={ids[0]},999999")
            expect(page.locator("#compare-error")).to_have_text("There is no job 999999.")
            expect(lines).to_have_count(1)
            # The browser logs the API's 404 itself: that is all it logged.
            assert all("/jobs/999999" in x for x in problems), problems
        finally:
            browser.close()
    finish(server, b)


def _js_number(v: float) -> str:
    """A value as chart.js's formatNumber writes it (4 significant digits)."""
    return f"{float(f'{v:.4g}')!r}".removesuffix(".0")
