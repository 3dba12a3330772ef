"""The worker's one loop (worker.executors.loop) with a stand-in executor and API, the one mapping
of why an attempt was stopped to how it ends (worker.starting.outcome), and the jittered backoff
(ddpq.wire): no server, no process."""

from __future__ import annotations

import itertools
import random
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpq.errors import ApiRefused, ApiUnavailable
from ddpq.messages import (
    AttemptKey,
    AttemptRef,
    ClaimedJob,
    HandBack,
    HeartbeatReply,
    HeldAttempt,
    PruneOrder,
    WorkerRegistered,
)
from ddpq.wire import Backoff
from worker.executors import slurm
from worker.executors.loop import Loop, Room, Stop, finish, stops
from worker.executors.settings import WorkerSettings
from worker.starting import torchrun
from worker.starting.outcome import STOP_REASONS, Outcome, stopped

# ---- the backoff -----------------------------------------------------------------------


def _delays(backoff: Backoff, n: int) -> list[float]:
    out = []
    stop = threading.Event()
    stop.set()  # wait() returns at once: only the delays drawn are looked at
    for _ in range(n):
        out.append(backoff.delay)
        backoff.wait(stop)
    return out


def test_two_workers_back_off_apart_within_the_bounds() -> None:
    a = _delays(Backoff(random.Random(1)), 40)
    b = _delays(Backoff(random.Random(2)), 40)
    # Workers that failed at once retry at different times from the first retry on.
    assert all(x != y for x, y in zip(a, b, strict=True))
    for delays in (a, b):
        assert all(Backoff.START_S <= d <= Backoff.MAX_S for d in delays), delays
        assert delays[0] <= 3 * Backoff.START_S  # the first retry stays quick
        assert max(delays) > Backoff.MAX_S / 2  # it does back off, up to its cap...
        assert Backoff.MAX_S not in delays  # ...drawn under it, not clamped to it in step
        # Each delay is drawn up to three times the last (decorrelated jitter).
        assert all(d <= 3 * last for last, d in itertools.pairwise(delays)), delays
    # The same seed draws the same delays: the jitter is the Random's, nothing else.
    assert _delays(Backoff(random.Random(1)), 40) == a


def test_a_success_resets_the_backoff() -> None:
    backoff = Backoff(random.Random(3))
    _delays(backoff, 20)
    backoff.reset()
    assert Backoff.START_S <= backoff.delay <= 3 * Backoff.START_S


# ---- how a stopped attempt ends --------------------------------------------------------


def test_every_stop_reason_ends_an_attempt_one_way_whatever_ran_it() -> None:
    [job] = slurm.parse_show_job("JobId=5 JobName=x JobState=CANCELLED ExitCode=0:15")
    for why in STOP_REASONS:
        words = "preempted by job 9" if why == "preempted" else None
        one = stopped(why, 60, None, words)
        # torchrun's exit and Slurm's end say the same, but for the exit code.
        on_host = torchrun.outcome(143, [], why, 60, words)
        assert (on_host.outcome, on_host.reason, on_host.exit_code) == (
            one.outcome,
            one.reason,
            143,
        )
        on_slurm = slurm.ending(job, why, 60, words)
        assert (on_slurm.outcome, on_slurm.reason, on_slurm.exit_code) == (
            one.outcome,
            one.reason,
            None,
        )
    assert stopped("cancelled", 60) == Outcome(None, "cancelled", "cancelled by user")
    assert stopped("timeout", 60) == Outcome(None, "timeout", "timeout after 60 s")
    assert stopped("shutdown", 60) == Outcome(None, "requeue", "worker shut down")
    assert stopped("shutdown", 60, None, "the bridge shut down").reason == "the bridge shut down"
    assert stopped("preempted", 60) == Outcome(None, "requeue", "preempted")
    assert stopped("preempted", 60, 143, "preempted by job 9") == Outcome(
        143, "requeue", "preempted by job 9"
    )
    assert stopped("abandoned", 60) == Outcome(None, "error", "abandoned")
    # Words are for a hand-back only: a cancel says it was cancelled.
    assert stopped("cancelled", 60, None, "whatever").reason == "cancelled by user"
    # Not stopped: the exit says how it ended.
    assert torchrun.outcome(0, [], None, None) == Outcome(0, "exited")
    assert slurm.ending(job, None, None).outcome == "lost"


# ---- the loop ----------------------------------------------------------------------------


class FakeExecutor:
    def __init__(self, detached: bool, running: list[tuple[int, int]]) -> None:
        self.detached = detached
        self.running = running
        self.stopped: list[tuple[int, int, str, str | None]] = []
        self.adopted: list[HeldAttempt] = []

    def describe(self) -> str:
        return "fake"

    def registration(self) -> dict[str, Any]:
        return {"cpu_slots": 1, "gpus": []}

    def attempts(self) -> list[dict[str, Any]]:
        return [{"job_id": j, "attempt": a, "external_id": f"x{j}"} for j, a in self.running]

    def adopt(self, held: list[HeldAttempt]) -> None:
        self.adopted = held

    def room(self, stop: threading.Event) -> Room | None:
        return Room(cpu_slots=1)

    def start(self, claim: ClaimedJob, room: Room) -> None:
        pass

    def stop(self, job_id: int, attempt: int, why: str, words: str | None = None) -> None:
        self.stopped.append((job_id, attempt, why, words))

    def rounds(self) -> list[tuple[str, float, Callable[[], None]]]:
        return []

    def gpu_samples(self) -> dict[AttemptKey, list[dict[str, Any]]]:
        return {}

    def drain(self) -> None:
        pass


class FakeAPI:
    def __init__(self) -> None:
        self.heartbeats: list[list[dict[str, Any]]] = []
        self.reports: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
        self.registered: list[dict[str, Any]] = []
        self.finished: list[tuple[int, dict[str, Any]]] = []
        self.reply: HeartbeatReply | Exception = HeartbeatReply(cancel=[], abandon=[])

    def heartbeat(
        self,
        running: list[dict[str, Any]],
        kept: list[int],
        pruned: list[dict[str, Any]] | None = None,
        dropped: list[dict[str, Any]] | None = None,
        caches: list[dict[str, Any]] | None = None,
        cleared: list[dict[str, Any]] | None = None,
        sent: list[dict[str, Any]] | None = None,
    ) -> HeartbeatReply:
        self.heartbeats.append(running)
        self.reports.append((pruned or [], dropped or []))
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def register(self, body: dict[str, Any]) -> WorkerRegistered:
        self.registered.append(body)
        held = [HeldAttempt(job_id=4, attempt=2, external_id="77")]
        return WorkerRegistered(name=body["name"], heartbeat_s=0.5, lease_s=5, held=held)

    def finish(self, job_id: int, body: dict[str, Any]) -> dict[str, Any]:
        self.finished.append((job_id, body))
        return {}

    def close(self) -> None:
        pass


def _loop(tmp_path: Path, executor: FakeExecutor) -> tuple[Loop, FakeAPI]:
    (tmp_path / "ws").mkdir(parents=True, exist_ok=True)
    settings = WorkerSettings(
        url="http://127.0.0.1:9/", workspace=tmp_path / "ws", data_dir=tmp_path / "data"
    )
    loop = Loop(executor, settings, token="t", default_name="fake-host")
    api = FakeAPI()
    loop.api = api  # type: ignore[assignment]
    return loop, api


def test_a_heartbeat_carries_the_executors_attempts_and_hands_on_what_the_reply_asks(
    tmp_path: Path,
) -> None:
    executor = FakeExecutor(detached=False, running=[(1, 1), (2, 1), (3, 1)])
    loop, api = _loop(tmp_path, executor)
    assert loop.name == "fake-host" and loop.url == "http://127.0.0.1:9"
    api.reply = HeartbeatReply(
        cancel=[AttemptRef(job_id=1, attempt=1), AttemptRef(job_id=9, attempt=1)],
        abandon=[AttemptRef(job_id=3, attempt=1)],
        preempt=[HandBack(job_id=2, attempt=1, reason="preempted by job 8")],
    )
    assert stops(api.reply) == [
        Stop(1, 1, "cancelled"),
        Stop(9, 1, "cancelled"),
        Stop(2, 1, "preempted", "preempted by job 8"),
        Stop(3, 1, "abandoned"),
    ]
    loop.heartbeat_once()
    assert api.heartbeats[-1][0] == {"job_id": 1, "attempt": 1, "external_id": "x1"}
    # Only attempts this worker sent are stopped (job 9 is not its own).
    assert executor.stopped == [
        (1, 1, "cancelled", None),
        (2, 1, "preempted", "preempted by job 8"),
        (3, 1, "abandoned", None),
    ]
    assert (tmp_path / "data").is_dir()  # health recorded


def test_a_reply_asking_to_delete_checkpoints_is_done_and_reported_once_answered(
    tmp_path: Path,
) -> None:
    executor = FakeExecutor(detached=False, running=[(2, 1)])
    loop, api = _loop(tmp_path, executor)
    old = loop.checkpoint_root / "job-1" / "step-1.pt"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"w")
    (loop.checkpoint_root / "job-2").mkdir()  # job 2 runs here: its directory stays
    api.reply = HeartbeatReply(
        cancel=[], abandon=[], prune=[PruneOrder(id=7, job_id=1, path=str(old))], drop=[2, 3]
    )
    loop.heartbeat_once()
    assert loop.pruner.wait_idle(10) and not old.exists()
    assert (loop.checkpoint_root / "job-2").is_dir()
    reports = ([{"id": 7, "outcome": "deleted", "why": None}], [
        {"job_id": 3, "outcome": "missing", "why": None}
    ])  # fmt: skip
    # A heartbeat that fails keeps the reports for the next one.
    api.reply = ApiUnavailable("POST", "/workers/heartbeat", 503, "database down")
    loop.heartbeat_once()
    api.reply = HeartbeatReply(cancel=[], abandon=[])
    loop.heartbeat_once()
    assert api.reports[-2:] == [reports, reports]
    loop.heartbeat_once()
    assert api.reports[-1] == ([], [])


def test_a_forgotten_worker_registers_again_and_a_superseded_one_stops(tmp_path: Path) -> None:
    for detached in (False, True):
        executor = FakeExecutor(detached=detached, running=[(1, 1)])
        loop, api = _loop(tmp_path / str(detached), executor)
        api.reply = ApiRefused("POST", "/workers/heartbeat", 404, "unknown worker")
        loop.heartbeat_once()
        assert api.registered[-1]["name"] == "fake-host"
        assert api.registered[-1]["cpu_slots"] == 1 and loop.heartbeat_s == 0.5
        assert not loop.stopping.is_set()
        api.reply = ApiRefused("POST", "/workers/heartbeat", 409, "name in use")
        loop.heartbeat_once()
        assert loop.stopping.is_set()
        # Attempts in this process are duplicates now; a detached executor's are the
        # new holder's to re-adopt, and are left alone.
        assert executor.stopped == ([] if detached else [(1, 1, "abandoned", None)])


def test_registering_hands_the_held_attempts_to_adopt(tmp_path: Path) -> None:
    executor = FakeExecutor(detached=True, running=[])
    loop, api = _loop(tmp_path, executor)
    held = loop.register()
    assert [(h.job_id, h.attempt, h.external_id) for h in held] == [(4, 2, "77")]
    assert api.registered[0]["checkpoint_root"] == str((tmp_path / "data/checkpoints").resolve())


def test_the_finish_report_skips_an_abandoned_attempt_and_a_handback_waits_for_the_claimer(
    tmp_path: Path,
) -> None:
    api = FakeAPI()
    ended = Outcome(None, "requeue", "worker shut down")
    finish(api, 5, 1, Outcome(3, "exited", "boom"), "abandoned")  # type: ignore[arg-type]
    assert api.finished == []
    finish(api, 5, 1, Outcome(3, "exited", "boom"))  # type: ignore[arg-type]
    assert api.finished == [
        (5, {"attempt": 1, "exit_code": 3, "outcome": "exited", "reason": "boom"})
    ]
    claimer_done = threading.Event()
    t = threading.Thread(
        target=finish,
        args=(api, 6, 1, ended, "shutdown", claimer_done),
    )
    t.start()
    t.join(0.3)
    assert t.is_alive() and len(api.finished) == 1  # held until the claim loop has ended
    claimer_done.set()
    t.join(5)
    assert api.finished[-1][1]["outcome"] == "requeue"


@pytest.mark.parametrize("detached", [False, True])
def test_a_stop_hands_back_only_what_runs_in_this_process(tmp_path: Path, detached: bool) -> None:
    executor = FakeExecutor(detached=detached, running=[(1, 1)])
    loop, _ = _loop(tmp_path, executor)
    loop.stopping.set()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        loop.run()  # registers, adopts, stops at once
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert [(h.job_id, h.attempt) for h in executor.adopted] == [(4, 2)]
    assert executor.stopped == ([] if detached else [(1, 1, "shutdown", None)])
    assert loop.claimer_done.is_set()


def test_an_ending_attempt_s_slots_go_into_the_claim_sent_while_its_end_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an attempt's processes are gone, the next claim offers its GPUs while its
    finish is still on the wire: the API hands them out once the finish commits (a
    claim sent meanwhile that left them out would keep them idle until it ended). It is
    still heartbeated until its end is answered."""
    from worker.executors import runner as runner_module
    from worker.executors.agent import Agent
    from worker.executors.runner import JobRunner

    (tmp_path / "ws").mkdir()
    settings = WorkerSettings(
        cpu_slots=4, gpus=[0, 1, 2, 3], url="http://127.0.0.1:9", name="w",
        workspace=tmp_path / "ws", data_dir=tmp_path / "data",
    )  # fmt: skip
    agent = Agent(settings, token="t")
    claim = ClaimedJob(
        job_id=1, attempt=1, token="x", spec={}, device="cuda", nproc_per_node=2,
        gpus=[0, 1], checkpoint_dir="/c", resume_from=[],
    )  # fmt: skip
    runner = JobRunner(agent.context, claim, agent.release, ending=agent.ending)
    with agent._lock:
        agent._runners[(1, 1)] = runner
    assert agent.free() == (4, [2, 3])
    while_reported: list[Any] = []
    monkeypatch.setattr(
        runner_module,
        "finish",
        lambda *_: while_reported.append((agent.free(), [r.job_id for r in agent.running()])),
    )
    runner._report(Outcome(0, "exited"))
    assert while_reported == [((4, [0, 1, 2, 3]), [1])]
    agent.release(runner)
    assert agent.free() == (4, [0, 1, 2, 3]) and agent.running() == []
