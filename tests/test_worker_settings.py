"""The worker's settings (worker/executors/settings.py): one object, whose fields are `ddpq
worker`'s flags and DDPQ_* variables. A bad value of each checked field is refused, naming its flag
and its variable, from a flag or from the environment (`ddpq worker` exits 2 with the
line); the defaults are written there alone (the CLI's options have none of their own,
and its help shows the object's); the executors take their values from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal, get_origin

import pytest
import typer
from pydantic_settings import NoDecode

from worker.executors.settings import SettingsError, WorkerSettings, _words, flag, shown, variable

REPO = Path(__file__).resolve().parent.parent

# A bad value of every field the settings check, as a flag or a variable gives it.
BAD: dict[str, tuple[str, str]] = {
    "workspace": ("/no/such/directory", "is not a directory"),
    "cpu_slots": ("-1", "must be at least 0, not -1"),
    "gpus": ("0,x", "takes 'none' or a list like 0,1,2,3"),
    "kill_grace_s": ("-1", "must be at least 0, not -1"),
    "rdzv_ports": ("29500-29400", "takes FIRST-LAST within 1-65535"),
    "code_cache_gb": ("-1", "must be at least 0, not -1"),
    "cache_gb": ("2e9", "must be less than 1e+09"),
    "keep_workdirs_s": ("-5", "must be at least 0, not -5"),
    "max_envs": ("0", "must be at least 1, not 0"),
    "executor": ("kubernetes", "takes 'local' or 'slurm'"),
    "max_pending": ("0", "must be at least 1, not 0"),
    "poll_s": ("0.1", "must be at least 0.2, not 0.1"),
    "job_uids": ("10-20", "a range of uids from 1000 up"),
    "pip_allow": ("urls", "'urls' is not a kind of requirement"),
    "launcher": ("cold", "takes 'torchrun' or 'warm'"),
    "log_level": ("loud", "takes debug, info, warning or error"),
}


def _checked_fields() -> set[str]:
    """The fields with a check: a bound, a validator of their own, or a closed set (the
    splitting of a list's words is none)."""
    found = set()
    for name, field in WorkerSettings.model_fields.items():
        checks = [
            m for m in field.metadata if m is not NoDecode and getattr(m, "func", None) != _words
        ]
        if checks or get_origin(field.annotation) is Literal:
            found.add(name)
    for decorator in WorkerSettings.__pydantic_decorators__.field_validators.values():
        found |= set(decorator.info.fields)
    return found


def test_every_checked_field_has_a_bad_value_here() -> None:
    assert _checked_fields() == set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_naming_its_flag_and_variable(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    value, said = BAD[name]
    given: Any = [value] if name == "pip_allow" else value
    with pytest.raises(SettingsError) as as_flag:
        WorkerSettings.load(**{name: given})
    assert str(as_flag.value).startswith(f"{flag(name)} / {variable(name)}: "), as_flag.value
    assert said in str(as_flag.value), as_flag.value
    monkeypatch.setenv(str(variable(name)), value)
    with pytest.raises(SettingsError) as as_variable:
        WorkerSettings.load()
    assert str(as_variable.value) == str(as_flag.value).replace(f"[{value!r}]", repr(value))


def test_a_bridge_needs_a_partition_and_several_bad_values_are_all_said() -> None:
    with pytest.raises(SettingsError, match="--executor slurm needs --partition"):
        WorkerSettings.load(executor="slurm")
    with pytest.raises(SettingsError) as both:
        WorkerSettings.load(kill_grace_s=-1, max_envs=0)
    assert "--kill-grace-s / DDPQ_KILL_GRACE_S" in str(both.value)
    assert "--max-envs / DDPQ_MAX_ENVS" in str(both.value)


def test_a_flag_wins_over_its_variable_and_the_job_s_checkpoint_variable_is_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPQ_KILL_GRACE_S", "3")
    monkeypatch.setenv("DDPQ_GPUS", "1,0")
    monkeypatch.setenv("DDPQ_PIP_ALLOW", "url option")
    monkeypatch.setenv("DDPQ_SBATCH_ARG", "--gres=gpu:2,shard:1 '--comment=a b'")
    monkeypatch.setenv("DDPQ_CHECKPOINT_DIR", "/a/job/s/own")  # the ranks' variable
    s = WorkerSettings.load(max_envs=2)
    assert (s.kill_grace_s, s.gpus, s.pip_allow, s.max_envs) == (3, [0, 1], ["url", "option"], 2)
    assert s.sbatch_arg == ["--gres=gpu:2,shard:1", "--comment=a b"]
    assert s.checkpoint_dir is None and variable("checkpoint_dir") is None
    assert WorkerSettings.load(kill_grace_s=5).kill_grace_s == 5


def _worker_command() -> Any:
    from ddpq.cli import app

    return typer.main.get_command(app).commands["worker"]  # type: ignore[attr-defined]


def test_the_cli_options_are_the_fields_and_their_defaults_the_objects() -> None:
    from ddpq.cli.servers import describe_settings

    command = _worker_command()
    options = {p.name: p for p in command.params if p.name != "help"}
    assert list(options) == list(WorkerSettings.model_fields)  # flags map to fields
    # The command writes no default of its own: all come from the object.
    assert all(p.default is None for p in options.values())
    describe_settings(command)
    for name, param in options.items():
        field = WorkerSettings.model_fields[name]
        assert param.opts == [flag(name)] and param.envvar == variable(name)
        assert param.help == field.description and param.default == shown(name)
    assert options["kill_grace_s"].default == "10" and options["max_envs"].default == "8"
    assert options["launcher"].default == "warm" and options["cache_gb"].default == "10"


def _ddpq_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}
    return subprocess.run(
        [sys.executable, "-m", "ddpq.cli", "worker", *args],
        capture_output=True,
        text=True,
        env={**clean, "COLUMNS": "200", **(env or {})},
        cwd=REPO,
        timeout=120,
    )


def test_ddpq_worker_help_shows_the_objects_defaults_and_a_bad_value_exits_2() -> None:
    helped = _ddpq_worker("--help")
    assert helped.returncode == 0, helped.stderr
    text = " ".join(helped.stdout.split())
    for name in ("kill_grace_s", "code_cache_gb", "max_envs", "launcher", "rdzv_ports"):
        assert f"{variable(name)}; default: {shown(name)}]" in text, (name, text)
    refused = _ddpq_worker("--kill-grace-s", "-1")
    assert refused.returncode == 2, refused.stderr
    said = " ".join(refused.stderr.split())
    assert "--kill-grace-s / DDPQ_KILL_GRACE_S: must be at least 0, not -1" in said, said
    from_env = _ddpq_worker(env={"DDPQ_MAX_ENVS": "0"})
    assert from_env.returncode == 2, from_env.stderr
    assert "--max-envs / DDPQ_MAX_ENVS: must be at least 1, not 0" in from_env.stderr


def test_the_executors_take_their_values_from_the_settings(tmp_path: Path) -> None:
    from worker.executors.agent import Agent

    (tmp_path / "ws").mkdir()
    settings = WorkerSettings(
        workspace=tmp_path / "ws", data_dir=tmp_path / "data", cpu_slots=3, gpus="none",
        kill_grace_s=4, code_cache_gb=0.5, cache_gb=0, max_envs=2, launcher="torchrun",
        rdzv_ports="30000-30009", pip_allow=["url"], name="w",
    )  # fmt: skip
    agent = Agent(settings, token="t")
    try:
        assert (agent.cpu_slots, agent.gpus, agent.rdzv_ports) == (3, [], (30000, 30009))
        assert agent.context.kill_grace_s == 4 and agent.context.launcher == "torchrun"
        assert agent.loop.venvs.max_envs == 2 and "url" in agent.loop.venvs.policy.allowed
        assert agent.loop.workdirs.cache.max_bytes == 500_000_000
        assert agent.loop.caches.cap_bytes == 0 and agent.name == "w"
    finally:
        agent.loop.api.close()


def test_the_bridge_takes_its_values_from_the_settings(tmp_path: Path) -> None:
    from worker.executors.bridge import Bridge

    settings = WorkerSettings(
        workspace=tmp_path, data_dir=tmp_path / "data", executor="slurm", partition="gpu",
        account="lab", sbatch_arg=["--gres=gpu:2,shard:1"], max_pending=3, poll_s=0.5,
        launcher="torchrun",
    )  # fmt: skip
    bridge = Bridge(settings, token="t")
    try:
        assert (bridge.partition, bridge.max_pending, bridge.poll_s) == ("gpu", 3, 0.5)
        assert bridge.launcher == "torchrun" and bridge.name.startswith("slurm-gpu@")
        assert bridge.submission.account == "lab"
        assert bridge.submission.extra == ("--gres=gpu:2,shard:1",)
    finally:
        bridge.loop.api.close()
