"""The warm launcher (issue 34): a rank forked from a warm process sees what a rank of a
cold torchrun sees, but for the differences docs/training.md lists; cancel, a failing
rank, and a killed rank behave as under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpq.jobspec import ClaimedSpec
from tests.conftest import Server, terminal, wait_for
from worker.edges.procs import find_by_launch_id
from worker.starting import warm
from worker.starting.warm import choose, zygote_env

pytestmark = [pytest.mark.torchrun, pytest.mark.launchers]

PROBE = Path(__file__).with_name("launcher_probe.py")

# What a rank may see differ between the launchers (docs/training.md, the warm launcher):
# values that differ from one run to the next anyway, under either launcher.
PER_RUN_ENV = {
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "DDPQ_JOB_ID",
    "DDPQ_JOB_TOKEN", "DDPQ_LAUNCH_ID", "DDPQ_CHECKPOINT_DIR", "TMPDIR",
    "TORCHELASTIC_RESTART_COUNT",
}  # fmt: skip
# compile_cache: whether the compiled graph was in the owner's cache, which the first of
# the two jobs fills.
PER_RUN = {"random", "torch_seed", "argv", "fds", "compile_cache"}
# ...and what the warm launcher changes: modules already imported (a superset: torch's,
# and what torch._dynamo brings, sympy, mpmath and triton, which every optimizer imports
# on its first step: worker.zygote.WARM_MODULES), the string hash seed, shared by one
# attempt's ranks.
WARM_ONLY_MODULE_PREFIXES = (
    "torch", "worker", "ddpq", "numpy", "multiprocessing", "sympy", "mpmath", "triton",
)  # fmt: skip


def _probe(
    server: Server, worker: Any, launcher: str, out: Path, *args: str, timeout: float = 120
) -> dict[str, Any]:
    out.mkdir()
    c = server.client()
    job = c.post(
        "/jobs",
        json={
            "entrypoint": "probe.py",
            "world_size": 2,
            "args": [str(out), *args],
            "launcher": launcher,
        },
    ).json()
    final = terminal(c, job["id"], timeout=timeout)
    final["log"] = c.get(f"/jobs/{job['id']}/logs").text
    final["ranks"] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return final


def _alike(cold: dict[str, Any], warm: dict[str, Any], tmp_path: Path) -> None:
    """The probe's ranks under the two launchers see the same, but for what may differ."""
    assert cold["status"] == warm["status"] == "succeeded", (cold["log"], warm["log"])
    assert "launcher: torchrun, not warm" not in warm["log"]
    for rank, (c, w) in enumerate(zip(cold["ranks"], warm["ranks"], strict=True)):
        # The warm rank did come from the warm process: torch was there before the program.
        assert set(c["modules"]) <= set(w["modules"]), rank
        extra = set(w["modules"]) - set(c["modules"])
        assert extra, "the warm launcher was not used"
        strange = sorted(m for m in extra if not m.startswith(WARM_ONLY_MODULE_PREFIXES))
        assert len(strange) < 200, strange  # stdlib modules torch's import brings
        assert c["argv"][0] == w["argv"][0] and c["argv"][2:] == w["argv"][2:]
        assert set(c["env"]) == set(w["env"]), set(c["env"]) ^ set(w["env"])
        for key in set(c["env"]) - PER_RUN_ENV:
            assert c["env"][key] == w["env"][key], key
        for key in set(c) - PER_RUN - {"env", "modules", "path", "main_file"}:
            assert c[key] == w[key], (rank, key, c[key], w[key])
        assert [p.replace(str(tmp_path / "cold"), "") for p in c["path"]] == [
            p.replace(str(tmp_path / "warm"), "") for p in w["path"]
        ]
        assert c["fds"] == w["fds"], rank
    assert cold["ranks"][0]["random"] != cold["ranks"][1]["random"]
    for key in ("random", "torch_seed"):
        assert warm["ranks"][0][key] != warm["ranks"][1][key], key


def test_a_rank_sees_what_it_sees_under_torchrun(
    server: Server, start_worker, tmp_path: Path
) -> None:
    worker = start_worker(server)
    shutil.copy(PROBE, worker.workspace / "probe.py")
    cold = _probe(server, worker, "torchrun", tmp_path / "cold")
    warm = _probe(server, worker, "warm", tmp_path / "warm")
    _alike(cold, warm, tmp_path)


# One backend: what is compared is the ranks', not the service's (a cold compile costs
# about 20 s of the first job here, the C++ headers' most of it).
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_compiled_step_sees_what_it_sees_under_torchrun(
    server: Server, start_worker, tmp_path: Path
) -> None:
    """The probe with a torch.compile'd DDP step: the compilers' settings as the rank sees
    them (a warm process imported them, in its own working directory, before the job),
    the step's loss and gradient to the bit. The warm side first: its forked ranks compile
    into their owner's empty cache on the worker, and the later cold job's first compiled
    step is warm, that cache's graph."""
    worker = start_worker(server)
    shutil.copy(PROBE, worker.workspace / "probe.py")
    warm = _probe(server, worker, "warm", tmp_path / "warm", "--compile", timeout=240)
    cold = _probe(server, worker, "torchrun", tmp_path / "cold", "--compile", timeout=240)
    _alike(cold, warm, tmp_path)  # "compiled" among what is compared
    for w, c in zip(warm["ranks"], cold["ranks"], strict=True):
        assert w["compiled"]["graphs"] == 1, w["compiled"]
        assert w["compile_cache"] == {"hit": 0, "miss": 1}, w["compile_cache"]
        assert c["compile_cache"] == {"hit": 1, "miss": 0}, c["compile_cache"]


def test_a_failing_rank_ends_the_job_as_under_torchrun(
    server: Server, start_worker, tmp_path: Path
) -> None:
    worker = start_worker(server)
    shutil.copy(PROBE, worker.workspace / "probe.py")
    cold = _probe(server, worker, "torchrun", tmp_path / "cold", "3")
    warm = _probe(server, worker, "warm", tmp_path / "warm", "3")
    for final in (cold, warm):
        assert final["status"] == "failed", final["log"]
        assert final["exit_code"] == 3, final
        assert "[ddpq] first to fail: rank 1 (local rank 1) exited with code 3" in final["log"]


STUBBORN = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.2)
"""


def test_cancel_leaves_no_forked_process_behind(
    server: Server, start_worker, tmp_path: Path
) -> None:
    worker = start_worker(server, "--kill-grace-s", "2", "--launcher", "warm")
    (worker.workspace / "stubborn.py").write_text(STUBBORN)
    out = tmp_path / "pids"
    out.mkdir()
    c = server.client()
    job = c.post(
        "/jobs", json={"entrypoint": "stubborn.py", "world_size": 2, "args": [str(out)]}
    ).json()
    wait_for(lambda: len(list(out.glob("rank*.pid"))) == 2, 60, "both ranks to start")
    launch_id = worker.launch_id(job["id"])
    # Found by their launch id, as a cold torchrun's: the agent, its template, two ranks.
    assert len(find_by_launch_id(launch_id)) >= 4
    assert c.post(f"/jobs/{job['id']}/cancel").status_code == 202
    final = terminal(c, job["id"], timeout=60)
    assert final["status"] == "cancelled" and final["exit_code"] == 137, final
    assert find_by_launch_id(launch_id) == []


def test_which_launcher() -> None:
    assert choose(ClaimedSpec(), "torchrun") == ("torchrun", None)
    assert choose(ClaimedSpec(), "warm") == ("warm", None)
    assert choose(ClaimedSpec(launcher="torchrun"), "warm") == ("torchrun", None)
    own_threads = ClaimedSpec(launcher="warm", env={"OMP_NUM_THREADS": "4"})
    launcher, why = choose(own_threads, "torchrun")
    assert launcher == "torchrun" and why and "OMP_NUM_THREADS" in why
    # The compiler's settings are read into its config as the warm process imports it;
    # where its caches are is read when first used, so a job may set that and stay warm.
    compiled = ClaimedSpec(launcher="warm", env={"TORCHINDUCTOR_FREEZING": "1"})
    assert choose(compiled, "warm")[0] == "torchrun"
    assert choose(ClaimedSpec(env={"TORCHDYNAMO_VERBOSE": "1"}), "warm")[0] == "torchrun"
    cache_dir = ClaimedSpec(env={"TORCHINDUCTOR_CACHE_DIR": "/data/c"})
    assert choose(cache_dir, "warm") == ("warm", None)
    # A warm process never holds what is the job's or ddpq's own.
    env = {"PATH": "/bin", "DDPQ_JOB_TOKEN": "ddpqj_x", "MY": "1", "TMPDIR": "/tmp/j"}
    z = zygote_env(env, ClaimedSpec(env={"MY": "1"}), 2)
    assert "DDPQ_JOB_TOKEN" not in z and "MY" not in z and "TMPDIR" not in z
    assert z["OMP_NUM_THREADS"] == "1" and z["PATH"] == "/bin"


def test_the_warm_process_started_ahead_is_the_one_a_plain_job_uses() -> None:
    """A worker with --launcher warm starts one before its first job: the one that job's
    environment keys (else the first job would start a second)."""
    from tests.test_bridge_protocol import _claim_of
    from worker.starting import torchrun
    from worker.starting.warm import default_zygote_env

    claim = _claim_of(nproc_per_node=2, device="cpu", spec={"env": {"MY": "1"}})
    at = torchrun.Placement("http://api", "/ckpt/job-12", "DDPQ_LAUNCH_ID", "w@x/12/3")
    env = torchrun.environment(os.environ, claim, at)
    assert zygote_env(env, claim.spec, 2) == default_zygote_env(2)


FORKED = r"""
import os, sys
import torch.distributed as dist
# torchrun's own module, which only a rank forked from the warm process has at its start.
print(f"rank {os.environ['RANK']} forked {'torch.distributed.run' in sys.modules}", flush=True)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def test_a_slurm_node_forks_its_ranks_from_a_warm_process_of_its_own(
    server: Server, tmp_path: Path
) -> None:
    """The bridge's plan says ``launcher: warm``: the node launcher (what srun starts, run
    here by hand on one node) starts a warm process of its own and forks torchrun from it."""
    import os
    import subprocess
    import sys

    from tests.test_bridge_protocol import _claim, _register_bridge

    _register_bridge(server, nodes=1, cpus_per_node=2)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "forked.py").write_text(FORKED)
    c = server.client()
    spec = {"entrypoint": "forked.py", "world_size": 2, "launcher": "warm"}
    job_id = c.post("/jobs", json=spec).json()["id"]
    claim = _claim(server)
    assert claim is not None
    plan_env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "DDPQ_URL": server.url,
        "DDPQ_JOB_ID": str(job_id),
        "DDPQ_JOB_TOKEN": claim["token"],
        "DDPQ_ATTEMPT": "1",
        "DDPQ_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "DDPQ_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    plan = {
        "claim": {k: v for k, v in claim.items() if k != "token"},
        "program": [str(workspace / "forked.py")],
        "env": plan_env,
        "comment": "ddpq bridge bridge -",
        "launcher": "warm",
    }
    node = subprocess.run(
        [sys.executable, "-m", "worker.slurmnode"],
        env={**plan_env, "DDPQ_SLURM_PLAN": json.dumps(plan)},
        cwd=workspace,
        capture_output=True,
        timeout=180,
    )
    out = node.stdout.decode(errors="replace") + node.stderr.decode(errors="replace")
    assert node.returncode == 0, out
    logs = c.get(f"/jobs/{job_id}/logs").text
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} forked True" in logs, logs


def test_a_worker_keeps_few_idle_warm_processes_and_never_one_an_attempt_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each warm process holds torch: past ``keep``, the least recently used idle one stops;
    one with a child (an attempt's agent) is not idle."""
    monkeypatch.setattr(warm, "IDLE_AFTER_S", 0.0)
    pool = warm.WarmPool(keep=1)
    try:
        first = pool.socket_for(sys.executable, warm.default_zygote_env(1))
        second = pool.socket_for(sys.executable, warm.default_zygote_env(2))
        # The first stopped when the second started: its socket is gone, one process left.
        assert len(pool) == 1 and not os.path.exists(first) and os.path.exists(second)
        assert pool.socket_for(sys.executable, warm.default_zygote_env(2)) == second
    finally:
        pool.stop()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert warm._children(os.getpid()) and not warm._children(child.pid)
    finally:
        child.kill()
        child.wait()


def test_the_sockets_of_a_killed_worker_are_swept_by_the_next(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a worker killed by -9: its pid is no one's now
    stale = tmp_path / f"{warm.DIR_PREFIX}{gone.pid}-x1"
    live = tmp_path / f"{warm.DIR_PREFIX}{os.getpid()}-x2"
    other = tmp_path / "ddpq-warm-unrelated"
    for d in (stale, live, other):
        d.mkdir()
        (d / "s").write_text("")
    warm.sweep_stale(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()


# torch.compile leaves weak proxies whose referents are gone in the heap; the way out
# once asked each for its __class__, and a finished program was failed (issue 42).
COMPILED = r"""
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
step = torch.compile(lambda x: model(x).pow(2).mean())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    loss = step(torch.ones(8, 4))
    loss.backward()
    opt.step()
print(f"rank {os.environ['RANK']} compiled loss {loss.item():.6f}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.long  # two compiles of a few seconds each: make test-long
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_compiled_program_that_finished_succeeds_under_both_launchers(
    server: Server, start_worker
) -> None:
    worker = start_worker(server)
    (worker.workspace / "compiled.py").write_text(COMPILED)
    c = server.client()
    ids = {
        launcher: c.post(
            "/jobs",
            json={"entrypoint": "compiled.py", "world_size": 2, "launcher": launcher,
                  "device": "cpu", "max_attempts": 1},
        ).json()["id"]
        for launcher in ("torchrun", "warm")
    }  # fmt: skip
    losses = {}
    for launcher, job_id in ids.items():
        final = terminal(c, job_id, timeout=300)
        log = c.get(f"/jobs/{job_id}/logs").text
        assert (final["status"], final["reason"]) == ("succeeded", None), (launcher, log)
        losses[launcher] = sorted(line.split("compiled loss ")[1] for line in log.splitlines()
                                  if "compiled loss " in line)  # fmt: skip
    assert len(losses["warm"]) == 2 and losses["warm"] == losses["torchrun"], losses
