"""`ddpq compare`: runs side by side, against a real `ddpq serve` on both databases (the
metrics are reported with each job's token, as rank 0 does): a row per job with the
metric's last and best value and step, its points and a trial's params, a sparkline per
job and the dashboard's URL of the comparison; --metric, --json; a job that does not
exist and jobs that share no metric refused in words (one server per database for the
module: each test compares jobs of its own). The pure parts (the default metric, a
resumed attempt's points, the sparkline) without a server."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ddpq.cli.compare import current_run, default_metric, higher_is_better, sparkline
from tests.conftest import Server, run_ddpq
from tests.helpers import finish, register, report


def _run(api: Server, **spec: Any) -> dict[str, Any]:
    """A job submitted with ``spec`` and claimed by the hand worker (its claim)."""
    register(api, "hand")
    r = api.client().post("/jobs", json={"entrypoint": "train.py", **spec})
    assert r.status_code == 201, r.text
    c = api.client("worker").post(
        "/workers/claim",
        json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5},
    )
    assert c.status_code == 200 and c.json()["job_id"] == r.json()["id"], c.text
    claim: dict[str, Any] = c.json()
    return claim


def _env(api: Server) -> dict[str, str]:
    return {"DDPQ_URL": api.url, "DDPQ_TOKEN": api.api_token}


def test_compare_shows_each_jobs_metric_its_sparkline_and_the_dashboards_url(
    api: Server,
) -> None:
    a = _run(api, name="base")
    b = _run(api, name="wide", params={"lr": 0.01, "act": "gelu"})
    # a: loss falling to 0.5 at step 20 (its best the last), accuracy rising.
    report(
        api,
        a,
        [{"step": s, "values": {"loss": 10 / s, "accuracy": s / 20}} for s in range(1, 21)],
    )
    # b: loss at its lowest (0.25) at step 8, then rising again; no accuracy.
    report(
        api,
        b,
        [{"step": s, "values": {"loss": 0.25 + abs(s - 8) / 10}} for s in range(2, 13, 2)],
    )
    finish(api, a)
    ids = f"{a['job_id']},{b['job_id']}"

    shown = run_ddpq("compare", str(a["job_id"]), str(b["job_id"]), env=_env(api))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert re.match(
        r"\s*JOB\s+NAME\s+STATE\s+LOSS\s+STEP\s+LOWEST\s+AT\s+POINTS\s+PARAMS", lines[0]
    )
    row_a = next(line for line in lines if line.split()[:2] == [str(a["job_id"]), "base"])
    assert row_a.split()[2:8] == ["succeeded", "0.5", "20", "0.5", "20", "20"], row_a
    row_b = next(line for line in lines if line.split()[:2] == [str(b["job_id"]), "wide"])
    assert row_b.split()[2:10] == ["running", "0.65", "12", "0.25", "8", "6", "lr=0.01", "act=gelu"]
    # A sparkline per job, of its loss: a's falls (its last block the lowest), b's dips.
    sparks = {
        int(line.split()[0]): line.split()[1]
        for line in lines
        if len(line.split()) == 2 and set(line.split()[1]) <= set("▁▂▃▄▅▆▇█")
    }
    assert sparks[a["job_id"]][0] == "█" and sparks[a["job_id"]][-1] == "▁", sparks
    assert len(sparks[a["job_id"]]) == 20 and len(sparks[b["job_id"]]) == 6, sparks
    assert sparks[b["job_id"]][3] == "▁" and sparks[b["job_id"]][0] > "▁", sparks
    assert lines[-1] == f"loss on one chart: {api.url}/#/compare?jobs={ids}"

    # --metric: one that only a has; accuracy's best is its highest. --json for scripts.
    got = run_ddpq(
        "compare", str(a["job_id"]), str(b["job_id"]), "--metric", "accuracy", "--json",
        env=_env(api),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    body = json.loads(got.stdout)
    assert body["metric"] == "accuracy" and body["best"] == "max"
    assert body["url"] == f"{api.url}/#/compare?jobs={ids}"
    first, second = body["jobs"]
    assert first["id"] == a["job_id"] and first["status"] == "succeeded"
    assert first["last"] == {"step": 20, "value": 1.0}
    assert first["best"] == {"step": 20, "value": 1.0}
    assert first["points"] == 20 and first["params"] == {}
    assert second["id"] == b["job_id"] and second["last"] is None and second["points"] == 0
    assert second["params"] == {"lr": 0.01, "act": "gelu"} and second["sparkline"] == ""
    # --best overrides what the name suggests.
    low = run_ddpq(
        "compare", str(a["job_id"]), "--metric", "accuracy", "--best", "min", "--json",
        env=_env(api),
    )  # fmt: skip
    assert json.loads(low.stdout)["jobs"][0]["best"] == {"step": 1, "value": 0.05}
    finish(api, b)


def test_compare_refuses_a_missing_job_and_says_when_jobs_share_no_metric(
    api: Server,
) -> None:
    a = _run(api, name="a")
    b = _run(api, name="b")
    report(api, a, [{"step": 1, "values": {"loss": 1.0}}])
    report(api, b, [{"step": 1, "values": {"reward": 3.0}}])
    env = _env(api)

    missing = run_ddpq("compare", str(a["job_id"]), "999999", env=env)
    assert missing.returncode == 2, (missing.stdout, missing.stderr)
    assert "there is no job 999999" in missing.stderr and not missing.stdout

    apart = run_ddpq("compare", str(a["job_id"]), str(b["job_id"]), env=env)
    assert apart.returncode == 2, (apart.stdout, apart.stderr)
    assert (
        f"jobs {a['job_id']}, {b['job_id']} share no metric "
        f"({a['job_id']}: loss; {b['job_id']}: reward)"
    ) in apart.stderr
    assert "--metric NAME" in apart.stderr

    unknown = run_ddpq("compare", str(a["job_id"]), "--metric", "acc", env=env)
    assert unknown.returncode == 2 and "reported 'acc'" in unknown.stderr, unknown.stderr
    # Asked for one they do not share: compared, the job without it left blank.
    one = run_ddpq("compare", str(a["job_id"]), str(b["job_id"]), "--metric", "reward", env=env)
    assert one.returncode == 0, one.stderr
    assert "(no points)" in one.stdout
    finish(api, a)
    finish(api, b)


def test_the_default_metric_is_the_first_shared_one_loss_first() -> None:
    assert default_metric([["acc", "loss", "lr"], ["loss", "lr"]]) == "loss"
    assert default_metric([["acc", "lr", "val"], ["lr", "val"]]) == "lr"
    assert default_metric([["loss"], ["reward"]]) is None
    assert default_metric([]) is None
    assert higher_is_better("val_accuracy") and higher_is_better("top1")
    assert not higher_is_better("loss") and not higher_is_better("accumulated")


def test_a_resumed_attempt_replaces_the_steps_it_reported_again() -> None:
    """Attempt 1 reached step 5; attempt 2 resumed at step 3 and reached 6; attempt 3
    resumed at 2: each earlier attempt counts before the step a later one began at."""
    items = [{"step": s, "attempt": 1, "values": {"loss": 1.0}} for s in range(1, 6)]
    items += [{"step": s, "attempt": 2, "values": {"loss": 2.0}} for s in range(3, 7)]
    items += [{"step": s, "attempt": 3, "values": {"loss": 3.0}} for s in range(4, 5)]
    items += [{"step": 7, "attempt": 3, "values": {"other": 1.0}}]
    items.sort(key=lambda i: (i["step"], i["attempt"]))
    assert current_run(items, "loss") == [(1, 1.0), (2, 1.0), (3, 2.0), (4, 3.0)]
    nan = [{"step": 1, "attempt": 1, "values": {"loss": "NaN"}}]
    assert math.isnan(current_run(nan, "loss")[0][1])


def test_a_sparkline_spans_the_blocks_from_the_lowest_to_the_highest() -> None:
    assert sparkline([]) == ""
    assert sparkline([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]) == "▁▂▃▄▅▆▇█"
    assert sparkline([2.0, 2.0]) == "▄▄"  # flat: the middle
    assert sparkline([1.0, math.nan, 3.0]) == "▁ █"
    long = sparkline([float(i) for i in range(1000)], width=40)
    assert len(long) == 40 and long[0] == "▁" and long[-1] == "█"
