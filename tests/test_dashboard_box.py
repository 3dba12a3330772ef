"""The dashboard's pages for the whole box, in a real browser (Playwright driving Debian's
Chromium) against a real `ddpq serve` on SQLite: the queue in the claims' order with each
job's place, words and estimated start; the workers and what each runs; usage, fair
share's turns and the last 30 days' accounting; the audit trail, for admins only."""

from __future__ import annotations

from typing import Any

from playwright.sync_api import expect, sync_playwright

from tests.conftest import Server
from tests.helpers import register
from tests.test_dashboard import _browser_page, _screenshot, sqlite_server  # noqa: F401

CPU = {"entrypoint": "t.py", "device": "cpu"}


def _rows(page: Any, table: str) -> Any:
    return page.locator(f"#{table} tbody tr")


def test_the_box_pages_show_the_queue_workers_usage_and_audit(sqlite_server: Server) -> None:  # noqa: F811
    server = sqlite_server
    admin = server.client()
    r = admin.post("/users", json={"name": "alice"})
    alice = server.client(r.json()["token"])
    register(server, "box-w", cpu_slots=1)
    running = admin.post("/jobs", json={**CPU, "timeout_s": 600}).json()["id"]
    claim = server.client("worker").post(
        "/workers/claim",
        json={"name": "box-w", "free_cpu_slots": 1, "free_gpus": [], "wait_s": 0},
    )
    assert claim.json()["job_id"] == running
    register(server, "box-gone", cpu_slots=1)  # a worker that stopped
    assert server.client("worker").post("/workers/leave", json={"name": "box-gone"}).is_success
    low = alice.post("/jobs", json={**CPU, "name": "low"}).json()["id"]
    high = admin.post("/jobs", json={**CPU, "name": "high", "priority": 3}).json()["id"]
    assert alice.post(f"/jobs/{low}/hold").status_code == 200
    assert alice.post(f"/jobs/{low}/release").status_code == 200
    problems: list[str] = []
    with sync_playwright() as p:
        browser, page = _browser_page(p, server, problems, "/#/queue")
        rows = _rows(page, "queue")
        expect(rows).to_have_count(2)
        expect(rows.nth(0)).to_have_attribute("data-job-id", str(high))
        expect(rows.nth(0)).to_contain_text(f"ahead of job {low}: priority 3 > 0")
        expect(rows.nth(0).locator("td.starts")).to_contain_text("(on worker box-w)")
        expect(page.locator("#queue-rules")).to_contain_text("2 queued; preemption off")
        _screenshot(page, "queue")

        page.click("#nav-workers")
        worker = page.locator('#workers tr[data-worker="box-w"]')
        expect(worker).to_contain_text(f"job {running} (admin)")
        expect(worker).to_contain_text("0/1")
        expect(page.locator('#workers tr[data-worker="box-gone"]')).to_contain_text("left")

        assert admin.put("/quotas/alice", json={"max_gpus": 2}).status_code == 200
        page.click("#nav-usage")
        expect(page.locator('#quotas tr[data-user="alice"]')).to_contain_text("2")
        expect(page.locator('#acct tr[data-user="(everyone)"]')).to_be_visible()
        expect(page.locator('#usage tr[data-user="admin"]')).to_be_visible()

        page.click("#nav-audit")
        audit = page.locator("#audit tbody")
        expect(audit).to_contain_text("hold")
        expect(audit).to_contain_text(f"job {low}")
        browser.close()

        # A member sees every page but the audit trail, which says it is for admins.
        browser = p.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"]
        )
        page = browser.new_page()
        page.goto(server.url + "/#/audit")
        page.fill("#token-input", r.json()["token"])
        page.click("#login button[type=submit]")
        expect(page.locator("#audit-empty")).to_have_text("The audit trail is for admins.")
        browser.close()
    assert not [x for x in problems if "403" not in x], problems
