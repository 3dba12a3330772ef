"""What the service has: its workers and its recipes."""

from __future__ import annotations

from typing import Any

from ddpq.cli.base import (
    JsonOpt,
    _age,
    _client,
    _fit_table,
    _gib,
    _gpu_use,
    _print_json,
    _print_table,
    _say,
    _text,
    client_command,
)


@client_command()
def workers(as_json: JsonOpt = False) -> None:
    """List workers and what they have free.

    CPU slots and GPUs (free of all), running jobs, last heartbeat. STATE: alive, lost (no
    heartbeat within the lease), leaving (it stopped: its jobs are being handed back) or
    left.
    """
    with _client() as c:
        items = c.workers()
    if as_json:
        _print_json(items)
        return
    rows = [
        [
            w["name"],
            w["hostname"],
            _state(w),
            *_slots(w),
            f"{_age(w['last_heartbeat'])} ago",
            " ".join(
                f"{j['job_id']}" + (f"[gpus {','.join(map(str, j['gpus']))}]" if j["gpus"] else "")
                for j in w["running"]
            )
            or "-",
        ]
        for w in items
    ]
    headers = ["NAME", "HOST", "STATE", "CPU FREE", "GPUS", "GPUS FREE", "HEARTBEAT", "RUNNING"]
    table = _fit_table(headers, rows, caps={"NAME": 24, "HOST": 24, "GPUS": 24})
    _print_table(table)
    # Each GPU NVML named, its holder and use: only where a worker has NVML.
    gpus = [
        [
            w["name"],
            str(g["index"]),
            g["name"],
            _gib(g["memory_total"]),
            "-" if g["job_id"] is None else str(g["job_id"]),
            g["owner"] or "-",
            _gpu_use(g["use"]) if g.get("use") else "-",
        ]
        for w in items
        for g in w.get("gpu_devices") or []
    ]
    if gpus:
        headers = ["WORKER", "GPU", "NAME", "MEMORY", "JOB", "OWNER", "USE"]
        _say("")
        _print_table(_fit_table(headers, gpus, caps={"WORKER": 24, "NAME": 28}))


def _state(w: dict[str, Any]) -> str:
    """A worker that stopped says so (an API of an earlier version sends no ``left_at``);
    a Slurm bridge's jobs go on running in Slurm without it."""
    if w.get("left_at"):
        return "leaving" if w["running"] and not w.get("cluster") else "left"
    return "alive" if w["alive"] else "lost"


def _slots(w: dict[str, Any]) -> list[str]:
    """CPU free, GPUs, GPUs free; for a Slurm bridge, its partition's nodes instead (Slurm
    keeps their books)."""
    shape = w.get("cluster")
    if shape:
        return [
            f"slurm {shape['partition']}",
            f"{shape['nodes']} node(s) x {shape['cpus_per_node']} CPUs",
            f"{shape['gpus_per_node']} GPUs/node",
        ]
    return [
        f"{w['free_cpu_slots']}/{w['cpu_slots']}",
        ",".join(map(str, w["gpus"])) or "-",
        ",".join(map(str, w["free_gpus"])) or "-",
    ]


@client_command()
def recipes(as_json: JsonOpt = False) -> None:
    """List the built-in recipes."""
    with _client() as c:
        items = c.recipes()
    if as_json:
        _print_json(items)
        return
    for r in items:
        _say(_text(r["name"], style="bold"), f"  {r['description']}")
        for a in r["args"]:
            rules = [a["type"]]
            if a.get("choices"):
                rules.append(f"one of {', '.join(a['choices'])}")
            rules += [f"{k} {a[k]}" for k in ("min", "max") if a.get(k) is not None]
            rules.append(f"default {a['default']!r}")
            _say(f"    {a['name']} ({', '.join(rules)}): {a['help']}")
