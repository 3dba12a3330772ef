"""`ddpq compare 12 13 14`: runs side by side. A row per job (its state, one metric's
last and best value, how many points it has, a trial's parameters), a sparkline of the
metric per job, and the dashboard's comparison of the same jobs (#/compare?jobs=...),
which draws them on one chart."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

import typer

from ddpq.cli.base import (
    EXIT_USAGE,
    JsonOpt,
    _client,
    _fail,
    _fit_table,
    _number,
    _print_json,
    _print_table,
    _say,
    _target,
    _text,
    client_command,
)
from ddpq.client import Client
from ddpq.errors import ApiRefused

BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40  # characters of each job's sparkline
# A metric whose best is its highest, by its name (as the dashboard's comparison has it);
# any other's best is its lowest.
HIGHER_IS_BETTER = re.compile(
    r"(^|[_./-])(acc|accuracy|auc|f1|precision|recall|bleu|rouge|map|iou|miou|reward|return"
    r"|score|top[15]|r2)([_./-]|$)",
    re.IGNORECASE,
)
JobIds = Annotated[list[int], typer.Argument(help="the jobs to compare (their ids)")]


def higher_is_better(metric: str) -> bool:
    return HIGHER_IS_BETTER.search(metric) is not None


def default_metric(names: list[list[str]]) -> str | None:
    """The first metric (by name) every job has, ``loss`` when they all have it."""
    if not names:
        return None
    shared = sorted(set(names[0]).intersection(*names[1:]))
    if "loss" in shared:
        return "loss"
    return shared[0] if shared else None


def as_float(v: Any) -> float:
    """A metric's value: the API sends NaN and the infinities as their names."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def current_run(items: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """``metric``'s (step, value) points as the job's latest attempt sees them: a resumed
    attempt reports again the steps from where it resumed, so an earlier attempt's points
    count only before the first step a later one reported (as the dashboard draws it)."""
    first: dict[int, int] = {}
    for item in items:
        if metric in item["values"]:
            a = int(item.get("attempt") or 0)
            first[a] = min(first.get(a, item["step"]), item["step"])
    cut: dict[int, float] = {}
    lowest = math.inf
    for a in sorted(first, reverse=True):
        cut[a] = lowest
        lowest = min(lowest, first[a])
    return [
        (item["step"], as_float(item["values"][metric]))
        for item in items
        if metric in item["values"] and item["step"] < cut[int(item.get("attempt") or 0)]
    ]


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """``values`` in at most ``width`` unicode blocks, lowest to highest: each block the
    mean of its share of the points; a share with no finite value is a space."""
    if not values:
        return ""
    n = min(width, len(values))
    means: list[float] = []
    for i in range(n):
        share = values[i * len(values) // n : (i + 1) * len(values) // n]
        finite = [v for v in share if math.isfinite(v)]
        means.append(sum(finite) / len(finite) if finite else math.nan)
    shown = [v for v in means if math.isfinite(v)]
    if not shown:
        return " " * n
    lo, hi = min(shown), max(shown)
    top = len(BLOCKS) - 1
    return "".join(
        " "
        if not math.isfinite(v)
        else BLOCKS[top // 2 if hi == lo else round((v - lo) / (hi - lo) * top)]
        for v in means
    )


def _job_or_usage(c: Client, job_id: int) -> dict[str, Any]:
    try:
        return c.job(job_id)
    except ApiRefused as exc:
        if exc.status == 404:
            _fail(f"there is no job {job_id}", EXIT_USAGE)
        raise


def _names(job: dict[str, Any]) -> list[str]:
    """The job's metrics: its latest metrics carry every series it reported."""
    latest = job.get("latest_metrics") or {}
    return sorted(latest.get("values") or {})


def _summary(job: dict[str, Any], points: list[tuple[int, float]], most: bool) -> dict[str, Any]:
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    best = (max if most else min)(finite, key=lambda p: p[1]) if finite else None
    last = points[-1] if points else None
    return {
        "id": job["id"],
        "name": job["name"],
        "status": job["status"],
        "last": {"step": last[0], "value": last[1]} if last else None,
        "best": {"step": best[0], "value": best[1]} if best else None,
        "points": len(points),
        "params": job["spec"].get("params") or {},
        "sparkline": sparkline([v for _, v in points]),
    }


def _json_value(v: float) -> Any:
    """As the API writes a value: NaN and the infinities by name (JSON has no number for them)."""
    return v if math.isfinite(v) else str(v).replace("inf", "Infinity").replace("nan", "NaN")


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={_number(v) if isinstance(v, float) else v}" for k, v in params.items())


def _fmt(point: dict[str, Any] | None) -> tuple[str, str]:
    return ("", "") if point is None else (_number(point["value"]), str(point["step"]))


@client_command(name="compare")
def compare(
    jobs: JobIds,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            metavar="NAME",
            help="the metric compared (default: the first every job has, loss if they do)",
        ),
    ] = None,
    best: Annotated[
        str | None,
        typer.Option(
            "--best",
            metavar="min|max",
            help="the best value is the lowest or the highest (default: highest for a "
            "score such as accuracy, else lowest)",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compare jobs: one metric's last and best value in each, its sparkline, and the
    dashboard's chart of them (its URL).

    --json prints {"metric", "best", "url", "jobs": [{"id", "name", "status", "last",
    "best", "points", "params", "sparkline"}]}.
    """
    if best not in (None, "min", "max"):
        _fail(f"--best is min or max, not {best!r}", EXIT_USAGE)
    ids = list(dict.fromkeys(jobs))
    with _client() as c:
        found = [_job_or_usage(c, i) for i in ids]
        names = [_names(j) for j in found]
        if metric is None:
            metric = default_metric(names)
            if metric is None:
                has = "; ".join(
                    f"{j['id']}: {', '.join(n) if n else 'none'}"
                    for j, n in zip(found, names, strict=True)
                )
                _fail(
                    f"jobs {', '.join(map(str, ids))} share no metric ({has}); "
                    "pick one with --metric NAME",
                    EXIT_USAGE,
                )
        elif not any(metric in n for n in names):
            _fail(f"none of jobs {', '.join(map(str, ids))} reported {metric!r}", EXIT_USAGE)
        most = best == "max" if best else higher_is_better(metric)
        rows = [
            _summary(j, current_run(c.metrics(j["id"], name=metric), metric), most) for j in found
        ]
    url = f"{_target().url}/#/compare?jobs={','.join(map(str, ids))}"
    if as_json:
        for r in rows:
            for key in ("last", "best"):
                if r[key]:
                    r[key]["value"] = _json_value(r[key]["value"])
        _print_json({"metric": metric, "best": "max" if most else "min", "url": url, "jobs": rows})
        return
    table = []
    for r in rows:
        last, last_step = _fmt(r["last"])
        top, top_step = _fmt(r["best"])
        table.append(
            [
                str(r["id"]), r["name"] or "", r["status"], last, last_step, top, top_step,
                str(r["points"]), _params(r["params"]),
            ]
        )  # fmt: skip
    word = "HIGHEST" if most else "LOWEST"
    headers = ["JOB", "NAME", "STATE", metric.upper(), "STEP", word, "AT", "POINTS", "PARAMS"]
    _print_table(_fit_table(headers, table, caps={"NAME": 24}))
    width = max(len(str(r["id"])) for r in rows)
    for r in rows:
        line = r["sparkline"] or _text("(no points)", style="dim")
        _say(f"{r['id']:>{width}} ", line)
    _say(_text(f"{metric} on one chart: {url}", style="dim"))
