"""Checkpoints a framework writes, and ddpq.integrations without one (issue 42).

ddpq.train.register_checkpoint registers a file or a directory already written inside
the job's checkpoint directory (refusing what no resume could reach), with its stamp; the
API records its kind, never lets two checkpoints nest, offers a directory to a resume and
has the worker delete it when keep_last lets it go, which the worker does only while the
directory is the one registered, walked without following a link. The integrations
import no framework until used and report only what is a metric. The programs of
docs/frameworks.md are those tests/test_frameworks.py runs (with the frameworks: slow).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpq.messages import PruneOrder
from ddpq.wire import tree_stamp
from tests.conftest import REPO, Server, start_server, stop_server
from tests.helpers import finish, submit_and_claim
from worker.files.checkpoints import delete_checkpoint
from worker.starting.torchrun import inside_job_dir

# ---- ddpq.train ---------------------------------------------------------------------------


@pytest.fixture
def sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What register_checkpoint sends, DDPQ_CHECKPOINT_DIR a directory of the test's."""
    from ddpq import train

    bodies: list[dict[str, Any]] = []

    class Sender:
        def add_checkpoint(self, body: dict[str, Any]) -> None:
            bodies.append(body)

    monkeypatch.setenv("DDPQ_CHECKPOINT_DIR", str(tmp_path / "ck"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(train, "_get_sender", lambda: Sender())
    (tmp_path / "ck").mkdir()
    return bodies


def test_register_checkpoint_sends_a_file_or_a_directory_as_written(
    tmp_path: Path, sent: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddpq import train

    ck = (tmp_path / "ck").resolve()
    (ck / "lightning").mkdir()
    f = ck / "lightning" / "epoch=0-step=8.ckpt"
    f.write_bytes(b"weights")
    assert train.register_checkpoint(f, step=8, epoch=1.0) == f
    st = f.stat()
    assert sent[-1] == {
        "path": str(f), "step": 8, "epoch": 1.0, "bytes": 7, "mtime_ns": st.st_mtime_ns
    }  # fmt: skip
    d = ck / "hf" / "checkpoint-16"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"abc")
    (d / "sub" / "rng_state_1.pth").write_bytes(b"de")
    # A relative path, through a link inside the directory, registers what it names.
    (ck / "latest").symlink_to(d, target_is_directory=True)
    monkeypatch.chdir(ck)
    assert train.register_checkpoint("latest", step=16, keep=True) == d
    size, mtime_ns = tree_stamp(str(d))
    assert size == 5
    assert sent[-1] == {
        "path": str(d), "step": 16, "kind": "dir", "keep": True, "bytes": 5, "mtime_ns": mtime_ns
    }  # fmt: skip
    monkeypatch.setenv("RANK", "1")  # other ranks: nothing, at once
    assert train.register_checkpoint("nowhere", step=1) is None
    assert len(sent) == 2


def test_register_checkpoint_refuses_what_no_resume_could_reach(
    tmp_path: Path, sent: list[dict[str, Any]]
) -> None:
    from ddpq import train

    ck = tmp_path / "ck"
    outside = tmp_path / "lightning_logs" / "a.ckpt"
    outside.parent.mkdir()
    outside.write_bytes(b"x")
    (ck / "link.ckpt").symlink_to(outside)
    for path in (outside, ck / "link.ckpt", ck, ck / ".." / "lightning_logs" / "a.ckpt"):
        with pytest.raises(ValueError, match="DDPQ_CHECKPOINT_DIR"):
            train.register_checkpoint(path, step=1)
    with pytest.raises(FileNotFoundError):
        train.register_checkpoint(ck / "not-yet.ckpt", step=1)
    os.mkfifo(ck / "fifo")
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        train.register_checkpoint(ck / "fifo", step=1)
    (ck / "a.pt").write_bytes(b"x")
    for step, error in ((-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error):
            train.register_checkpoint(ck / "a.pt", step=step)  # type: ignore[arg-type]
    assert sent == []


def test_resume_path_is_what_the_worker_offers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from ddpq import train

    monkeypatch.delenv("DDPQ_RESUME_FROM", raising=False)
    assert train.resume_path() is None
    d = tmp_path / "checkpoint-8"
    monkeypatch.setenv("DDPQ_RESUME_FROM", str(d))
    assert train.resume_path() is None  # gone: a fresh start, not a crash in the framework
    d.mkdir()
    assert train.resume_path() == d
    assert "resume_path" in train.__all__ and "register_checkpoint" in train.__all__


def test_a_directory_stamp_changes_with_anything_written_inside(tmp_path: Path) -> None:
    d = tmp_path / "state"
    (d / "deep").mkdir(parents=True)
    (d / "deep" / "a.bin").write_bytes(b"aaaa")
    (d / "link").symlink_to(tmp_path)  # counted as itself, never followed
    first = tree_stamp(str(d))
    assert first[0] == 4 and tree_stamp(str(d)) == first
    os.utime(d / "deep" / "a.bin", ns=(1, first[1] + 10**9))
    assert tree_stamp(str(d))[1] == first[1] + 10**9
    (d / "deep" / "b.bin").write_bytes(b"b")
    assert tree_stamp(str(d))[0] == 5


# ---- the worker ---------------------------------------------------------------------------


@pytest.fixture
def ckroot(tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    (root / "job-7").mkdir(parents=True)
    return root


def _dir_order(path: Path | str, stamp: tuple[int, int], **kw: Any) -> PruneOrder:
    return PruneOrder(
        id=1, job_id=7, path=str(path), bytes=stamp[0], mtime_ns=stamp[1], kind="dir", **kw
    )


def test_a_directory_checkpoint_goes_whole_only_while_it_is_the_one_registered(
    tmp_path: Path, ckroot: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.pt").write_bytes(b"x")
    d = ckroot / "job-7" / "accelerate" / "checkpoint_0"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "sub" / "link").symlink_to(victim, target_is_directory=True)
    stamp = tree_stamp(str(d))
    # Written again since it was registered: left for its new registration.
    (d / "random_states_1.pkl").write_bytes(b"r")
    assert delete_checkpoint(ckroot, _dir_order(d, stamp))[0] == "refused" and d.exists()
    stamp = tree_stamp(str(d))
    # A file's order never deletes a directory, nor a directory's a file.
    file_order = PruneOrder(id=1, job_id=7, path=str(d), bytes=stamp[0], mtime_ns=stamp[1])
    assert delete_checkpoint(ckroot, file_order)[0] == "refused"
    f = ckroot / "job-7" / "a.pt"
    f.write_bytes(b"x")
    assert delete_checkpoint(ckroot, _dir_order(f, tree_stamp(str(f))))[0] == "refused"
    assert delete_checkpoint(ckroot, _dir_order(ckroot / "job-7", stamp))[0] == "refused"
    assert delete_checkpoint(ckroot, _dir_order(victim, stamp))[0] == "refused"
    assert delete_checkpoint(ckroot, _dir_order(d, stamp)) == ("deleted", None)
    assert not d.exists() and (victim / "precious.pt").exists() and f.exists()
    assert delete_checkpoint(ckroot, _dir_order(d, stamp)) == ("missing", None)
    # Swapped for a link to a directory outside: the link is not followed.
    (d.parent / "checkpoint_1").symlink_to(victim, target_is_directory=True)
    outcome, why = delete_checkpoint(ckroot, _dir_order(d.parent / "checkpoint_1", stamp))
    assert outcome == "refused" and "symbolic link" in str(why)
    assert (victim / "precious.pt").exists()


def test_the_worker_resumes_from_a_directory_inside_the_jobs_directory(tmp_path: Path) -> None:
    job = tmp_path / "job-7"
    d = job / "transformers" / "checkpoint-8"
    d.mkdir(parents=True)
    (job / "out").symlink_to(tmp_path, target_is_directory=True)
    assert inside_job_dir(str(d), 7)
    assert not inside_job_dir(str(job), 7)  # the job's directory itself is no checkpoint
    assert not inside_job_dir(str(job / "out"), 7)
    assert not inside_job_dir(str(d), 8)


# ---- the API ------------------------------------------------------------------------------


@pytest.fixture
def quick(db_url: str, tmp_path: Path) -> Any:
    s = start_server(db_url, tmp_path / "api", DDPQ_RETRY_BACKOFF_S="0")
    yield s
    stop_server(s)


def _post(server: Server, claim: dict[str, Any], rel: str, step: int, **extra: Any) -> Any:
    return server.client(claim["token"]).post(
        f"/jobs/{claim['job_id']}/checkpoints",
        json={"path": f"{claim['checkpoint_dir']}/{rel}", "step": step, **extra},
    )


def test_a_directory_registers_goes_to_its_worker_to_delete_and_is_offered_to_a_resume(
    quick: Server,
) -> None:
    claim = submit_and_claim(quick, keep_last=1, max_attempts=2)
    jid = claim["job_id"]
    for step in (8, 16):
        r = _post(quick, claim, f"hf/checkpoint-{step}", step, kind="dir", bytes=5, mtime_ns=9)
        assert r.status_code == 201 and r.json()["kind"] == "dir", r.text
    items = quick.client().get(f"/jobs/{jid}/checkpoints").json()["items"]
    assert [(c["step"], c["kind"], c["state"]) for c in items] == [
        (8, "dir", "pruning"), (16, "dir", "kept")
    ]  # fmt: skip
    reply = quick.client("worker").post("/workers/heartbeat", json={"name": "hand"}).json()
    assert [(o["path"], o["kind"], o["bytes"], o["mtime_ns"]) for o in reply["prune"]] == [
        (f"{claim['checkpoint_dir']}/hf/checkpoint-8", "dir", 5, 9)
    ]
    assert finish(quick, claim, exit_code=137)["status"] == "queued"  # a kill: retried
    again = quick.client("worker").post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert again.status_code == 200, again.text
    assert again.json()["resume_from"][0] == f"{claim['checkpoint_dir']}/hf/checkpoint-16"


def test_checkpoints_never_nest_and_a_bad_kind_is_refused(quick: Server) -> None:
    claim = submit_and_claim(quick, keep_last=0)
    assert _post(quick, claim, "accelerate/checkpoint_0", 1, kind="dir").status_code == 201
    assert _post(quick, claim, "files/a.pt", 2).status_code == 201
    for rel, kind, words in (
        ("accelerate/checkpoint_0/model.safetensors", "file", "inside the registered"),
        ("accelerate/checkpoint_0/sub", "dir", "inside the registered"),
        ("files", "dir", "holds the registered"),
        ("accelerate", "dir", "holds the registered"),
    ):
        r = _post(quick, claim, rel, 3, kind=kind)
        assert r.status_code == 422 and "path" in r.text and words in r.text, (rel, r.text)
    # A name that only begins like one is not inside it; the same path again supersedes.
    assert _post(quick, claim, "accelerate/checkpoint_0x", 4, kind="dir").status_code == 201
    assert _post(quick, claim, "accelerate/checkpoint_0", 5, kind="dir").status_code == 201
    for bad in ("folder", "", 1, None):
        r = _post(quick, claim, "x", 6, kind=bad)
        assert r.status_code == 422 and "kind" in r.text, (bad, r.text)
    items = quick.client().get(f"/jobs/{claim['job_id']}/checkpoints").json()["items"]
    assert [(c["step"], c["state"]) for c in items] == [
        (1, "pruned"), (2, "kept"), (4, "kept"), (5, "kept")
    ]  # fmt: skip


# ---- ddpq.integrations, without a framework -------------------------------------------------


def test_the_integrations_import_no_framework_until_used() -> None:
    import subprocess

    code = (
        "import sys, ddpq.integrations.lightning, ddpq.integrations.accelerate,"
        " ddpq.integrations.ignite, ddpq.integrations.transformers\n"
        "heavy = {'torch', 'pytorch_lightning', 'lightning', 'accelerate', 'ignite',"
        " 'transformers'}\n"
        "print(sorted(heavy & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_only_metrics_are_reported_and_a_bad_point_is_said_not_raised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from ddpq import integrations, train

    points: list[tuple[int, dict[str, Any]]] = []
    monkeypatch.setattr(train, "report", lambda step, **kw: points.append((step, kw)))
    logged = {"loss": torch.tensor(0.5), "lr": 0.1, "name": "x", "flag": True, "w": torch.ones(2)}
    integrations.report(3, logged, epoch=1.0)
    assert [(step, sorted(kw)) for step, kw in points] == [
        (3, ["epoch", "loss", "lr", "total_steps"])
    ]
    assert float(points[0][1]["loss"]) == 0.5 and points[0][1]["epoch"] == 1.0
    integrations.report(4, {"name": "x"})  # nothing that is a metric: no point
    assert len(points) == 1
    assert [integrations.total(v) for v in (24, 24.0, float("inf"), 0, None, True)] == [
        24, 24, None, None, None, None
    ]  # fmt: skip
    monkeypatch.undo()
    integrations.report(5, {"x" * 300: 1.0})
    integrations.report(6, {"x" * 300: 1.0})
    err = capsys.readouterr().err
    assert err.count("a metric point left out") == 1


def test_the_docs_show_the_programs_the_tests_run() -> None:
    from tests.test_frameworks import FRAMEWORKS

    page = (REPO / "docs" / "frameworks.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    programs = sorted((REPO / "examples" / "frameworks").glob("train_*.py"))
    # The examples are the programs tests/test_frameworks.py runs, torch.compile's among them.
    assert {p.name for p in programs} == {fw.program for fw in FRAMEWORKS.values()}
    assert "train_compile.py" in {p.name for p in programs}
    for program in programs:
        assert program.read_text() in blocks, f"docs/frameworks.md lacks {program.name} as it is"
