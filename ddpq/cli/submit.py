"""Submitting jobs: submit and resubmit, the spec flags they share, the code they send,
and what they say of it (inspecting, listing and cancelling are ddpq.cli.jobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ddpq import codepack
from ddpq.cli.base import (
    EXIT_API,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_UNSCHEDULABLE,
    EXIT_USAGE,
    JsonOpt,
    _client,
    _fail,
    _print_json,
    _program,
    _say,
    _text,
    client_command,
    err,
)
from ddpq.cli.jobflags import (
    SPEC_FLAGS,
    AfterOpt,
    Args,
    ArrayOpt,
    Device,
    EnvOpt,
    ForkOpt,
    KeepLast,
    Launcher,
    MaxAttempts,
    MaxRestarts,
    Name,
    Nnodes,
    PipOpt,
    Priority,
    RetryOnError,
    SecretOpt,
    Strict,
    TimeoutS,
    Wait,
    WorldSize,
    _fork,
    _override,
)
from ddpq.cli.live import follow
from ddpq.cli.spec import _read_spec_file, secret_like_env
from ddpq.client import Client
from ddpq.errors import CodeError
from ddpq.rules import UNSCHEDULABLE, array_indices, is_unschedulable
from ddpq.snapshot import file_count, human_bytes

PROGRESS_MIN_BYTES = 1_000_000  # a smaller upload is over before a bar would help


# submit's own options (those it shares with resubmit are ddpq.cli.jobflags').
FileOpt = Annotated[
    str | None,
    typer.Option(
        "--file", "-f", help="a job spec in YAML or JSON (- for stdin); flags override it"
    ),
]
RecipeOpt = Annotated[
    str | None, typer.Option(metavar="NAME", help="a built-in recipe (ddpq recipes)")
]
EntrypointOpt = Annotated[
    str | None,
    typer.Option(
        metavar="FILE",
        help="a script in the code sent with the job (or, with --no-code, in the worker's "
        "workspace)",
    ),
]
WorkdirOpt = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR", help="the directory sent as the job's code (default: the current one)"
    ),
]
NoCodeOpt = Annotated[
    bool, typer.Option("--no-code", help="send no code: run from the worker's workspace")
]
KeyOpt = Annotated[
    str | None,
    typer.Option(metavar="KEY", help="a repeat with the same key and spec returns the first job"),
]


@client_command(context_settings={"allow_interspersed_args": False})
def submit(
    args: Args = None,
    file: FileOpt = None,
    recipe: RecipeOpt = None,
    entrypoint: EntrypointOpt = None,
    workdir: WorkdirOpt = None,
    no_code: NoCodeOpt = False,
    world_size: WorldSize = None,
    nnodes: Nnodes = None,
    name: Name = None,
    device: Device = None,
    priority: Priority = None,
    max_attempts: MaxAttempts = None,
    max_restarts: MaxRestarts = None,
    retry_on_error: RetryOnError = None,
    timeout_s: TimeoutS = None,
    keep_last: KeepLast = None,
    launcher: Launcher = None,
    env: EnvOpt = None,
    pip: PipOpt = None,
    secret: SecretOpt = None,
    after: AfterOpt = None,
    from_checkpoint: ForkOpt = None,
    array: ArrayOpt = None,
    idempotency_key: KeyOpt = None,
    wait: Wait = False,
    strict: Strict = False,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job.

    --entrypoint FILE (with the current directory as its code), --recipe NAME, or
    -f job.yaml; [-- ARGS...] for the program.

    The spec file (YAML or JSON, - for stdin) holds the fields of POST /jobs, and may
    say `workdir: DIR` (relative to the file) or `no_code: true`.

    Flags given too override its fields; --env, --pip, --secret and --after add to its
    lists.
    An --env value is shown to everyone who lists jobs: pass a key or token with
    --secret NAME instead (`ddpq secrets set NAME` first).
    """
    if recipe is not None and entrypoint is not None:
        _fail("give exactly one of --recipe and --entrypoint", EXIT_USAGE)
    spec: dict[str, Any] = _read_spec_file(file) if file is not None else {}
    # A program given on the command line replaces the file's, whichever kind it is.
    if recipe is not None:
        spec.pop("entrypoint", None)
    if entrypoint is not None:
        spec.pop("recipe", None)
    flags = {k: v for k, v in locals().items() if k in SPEC_FLAGS}
    _override(
        spec, {"recipe": recipe, "entrypoint": entrypoint, **flags}, args, env, pip, secret, after
    )
    if from_checkpoint is not None:
        spec["from_checkpoint"] = _fork(from_checkpoint)
    if spec.get("recipe") is None and spec.get("entrypoint") is None:
        _fail(
            "give exactly one of --recipe and --entrypoint (or recipe/entrypoint in -f FILE)",
            EXIT_USAGE,
        )
    tasks = _array(array, wait, idempotency_key, strict) if array is not None else None
    code_dir = _code_dir(spec, file, workdir, no_code)
    if code_dir is not None:
        pushed = _push(code_dir, quiet=as_json)
        spec["code"] = pushed.id
        if pushed.checkpoints:
            _warn(_checkpoint_words(pushed.checkpoints))
    else:
        pushed = None
    if tasks is not None:
        _submit_array(spec, *tasks, as_json, pushed)
        return
    _submit(spec, idempotency_key, wait, strict, as_json, pushed)


def _array(given: str, wait: bool, key: str | None, strict: bool) -> tuple[str, int | None]:
    """--array's indices and its %N, checked before any code is sent."""
    refused = [
        f for f, on in (("--wait", wait), ("--idempotency-key", key), ("--strict", strict)) if on
    ]
    if refused:
        _fail(f"--array makes a sweep of jobs: {refused[0]} is for one job", EXIT_USAGE)
    indices, _, limit = given.partition("%")
    try:
        array_indices(indices)
    except ValueError as exc:
        raise typer.BadParameter(f"{given!r}: {exc}", param_hint="--array") from None
    if limit and not (limit.isdigit() and int(limit) >= 1):
        raise typer.BadParameter(
            f"{given!r}: %N is a number of tasks, 1 or more", param_hint="--array"
        )
    # (The API bounds N: the sweep's max_concurrent.)
    return indices, int(limit) if limit else None


def _submit_array(
    spec: dict[str, Any],
    indices: str,
    at_once: int | None,
    as_json: bool,
    pushed: codepack.Pushed | None,
) -> None:
    """Submit ``spec`` as an array: a sweep over ``index`` (its name the sweep's)."""
    shown = secret_like_env(spec)
    if shown:
        _warn(shown)
    sweep: dict[str, Any] = {"name": spec.pop("name", None), "job": spec, "array": indices}
    if at_once is not None:
        sweep["max_concurrent"] = at_once
    submit_sweep(sweep, as_json, pushed)


def submit_sweep(sweep: dict[str, Any], as_json: bool, pushed: codepack.Pushed | None) -> None:
    """POST the sweep (or array) and say what it is, or print it (--json)."""
    with _client() as c:
        made = c.submit_sweep(sweep)
    if as_json:
        _print_json(made)
        return
    say_submitted(made, _code_words(pushed) if pushed else None)


def _code_dir(
    spec: dict[str, Any], file: str | None, workdir: Path | None, no_code: bool
) -> Path | None:
    """The directory to send as the job's code, or None for none: --no-code (or
    ``no_code: true`` in the spec file), a spec naming its snapshot already (``code:
    ID``), or a recipe with no directory given. An entrypoint takes the current one."""
    file_dir = spec.pop("workdir", None)
    file_no_code = spec.pop("no_code", False)
    if no_code or file_no_code is True or spec.get("code"):
        return None
    if workdir is not None:
        return workdir
    if isinstance(file_dir, str):
        here = Path(file).parent if file is not None and file != "-" else Path(".")
        return here / file_dir
    return Path(".") if spec.get("entrypoint") or not spec.get("recipe") else None


def _push(root: Path, quiet: bool) -> codepack.Pushed:
    """Send ``root`` as the job's code, with a progress bar on a terminal for large uploads."""
    if not root.is_dir():
        _fail(f"--workdir {root} is not a directory", EXIT_USAGE)
    bar: Progress | None = None
    task: Any = None

    def progress(sent: int, total: int) -> None:
        nonlocal bar, task
        if quiet or not err.is_terminal or total < PROGRESS_MIN_BYTES:
            return
        if bar is None:
            bar = Progress(
                TextColumn("code"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                console=err, transient=True,
            )  # fmt: skip
            bar.start()
            task = bar.add_task("upload", total=total)
        bar.update(task, completed=sent)

    try:
        with _client() as c:
            return c.push_code(root, progress)
    finally:
        if bar is not None:
            bar.stop()


def _warn(message: str) -> None:
    """A warning, in one line on stderr (stdout stays the command's answer)."""
    err.print(_text(f"warning: {message}"), highlight=False, soft_wrap=True)


def _checkpoint_words(found: list[tuple[str, int]]) -> str:
    """The warning for checkpoint-like files sent with the code (a stale local
    snapshot.pt went with the next submit, and the job silently "resumed" from it)."""
    named = ", ".join(f"{path} ({human_bytes(size)})" for path, size in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    return (
        f"sending checkpoint-like file(s) with the code: {named}{more}. A program that "
        "resumes from a file in its directory starts from these; leave them out with "
        ".ddpqignore, or run on from a job's own with `ddpq resubmit --resume JOB`"
    )


LEFT_OUT_SHOWN = 5  # the largest things left out, named; the rest counted


def _code_words(p: codepack.Pushed) -> str:
    sent = f"{p.new} new, {human_bytes(p.sent)} sent"
    return f"code: {file_count(p.files)}, {human_bytes(p.bytes)} ({sent})"


def _code_notes(p: codepack.Pushed) -> list[str]:
    """What stayed home, largest first, and what else was skipped: a job runs in a fresh
    directory on the worker, so what is not sent is not there."""
    shown = [o.words() for o in p.left_out[:LEFT_OUT_SHOWN]]
    rest = p.left_out[LEFT_OUT_SHOWN:]
    if rest:
        shown.append(f"{len(rest)} more ({human_bytes(sum(o.bytes for o in rest))})")
    shown += p.skipped
    return [f"left out: {'; '.join(shown)}"] if shown else []


def _code_warnings(p: codepack.Pushed) -> list[str]:
    """A sent program that names something left out would look for it on the worker."""
    return [
        f"warning: {source} names {what}, which was left out and will not be in the job's"
        " directory on the worker: put data on a path the worker's host has and pass it"
        " as an argument (ddpq's docs: where data goes)"
        for source, what in p.named
    ]


def _submit(
    spec: dict[str, Any],
    idempotency_key: str | None,
    wait: bool,
    strict: bool,
    as_json: bool,
    pushed: codepack.Pushed | None,
    words: str = "",
) -> None:
    """Submit ``spec`` and say so: what of the code was sent (``pushed``) or ``words``
    (resubmit's: which snapshot), then, with ``wait``, follow it to its end."""
    shown = secret_like_env(spec)
    if shown:
        _warn(shown)
    with _client() as c:
        job = c.submit(spec, idempotency_key, strict)
        try:
            job = _said_and_followed(c, job, wait, as_json, pushed, words)
        except KeyboardInterrupt as exc:
            # Anywhere after the API took the job (while printing its line, importing
            # the live view, polling), Ctrl-C stops the waiting and says the job goes on.
            seen = getattr(exc, "job", None) or job
            _fail(
                f"interrupted: job {seen['id']} is still {seen['status']} (Ctrl-C stops the"
                f" waiting, not the job); `ddpq watch {seen['id']}` follows it, `ddpq cancel"
                f" {seen['id']}` cancels it",
                EXIT_INTERRUPTED,
            )
        if not wait:
            return
    if as_json:
        _print_json(job)
    if _never_runs(job):
        why = job["reason"].removeprefix(f"{UNSCHEDULABLE}: ")
        _fail(
            f"no registered worker can ever run job {job['id']}: {why}. It stays queued"
            f" until one that can registers; `ddpq cancel {job['id']}` cancels it",
            EXIT_UNSCHEDULABLE,
        )
    if job["status"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


def _said_and_followed(
    c: Client,
    job: dict[str, Any],
    wait: bool,
    as_json: bool,
    pushed: codepack.Pushed | None,
    words: str,
) -> dict[str, Any]:
    """Print the accepted job's line and, with --wait, follow it to its end; returns the
    last Job seen. Ctrl-C raises KeyboardInterrupt (Interrupted, with the job, while
    following)."""
    line = (
        f"job {job['id']} {job['status']} ({_program(job)}, world size {job['spec']['world_size']})"
    )
    if as_json:
        if wait:  # stdout is for the final Job; the id, at once, goes to stderr
            err.print(_text(f"{line}; waiting for it to end"), highlight=False)
    else:
        said = _code_words(pushed) if pushed else words
        _say(f"{said} · {line}" if said else line)
        for note in _code_notes(pushed) if pushed else []:
            _say(f"  {note}")
        if job.get("reason") and not wait:
            _say(f"  {job['reason']}")
    for warning in _code_warnings(pushed) if pushed else []:
        err.print(_text(warning), highlight=False, soft_wrap=True)
    if not wait:
        if as_json:
            _print_json(job)
        return job
    return follow(c, job["id"], 1.0, False, _never_runs, quiet=as_json)


def say_submitted(sweep: dict[str, Any], code_words: str | None) -> None:
    """What a new sweep (or array) is and which jobs its first trials are."""
    s = sweep["spec"]
    trials = sweep["trials"] or []
    jobs = ", ".join(str(t["job_id"]) for t in sorted(trials, key=lambda t: t["number"]))
    if s.get("array") is not None:
        line = (
            f"array {s['array']} (sweep {sweep['id']}) {sweep['status']}: "
            f"{sweep['max_trials']} tasks, {s['max_concurrent']} at once"
        )
    else:
        line = (
            f"sweep {sweep['id']} {sweep['status']}: {s['method']} over "
            f"{', '.join(s['space'])}, {sweep['max_trials']} trials, {s['max_concurrent']} "
            f"at once{sweep_aim(s)}"
        )
    _say(f"{code_words} · {line}" if code_words else line)
    if jobs:
        _say(f"  {'tasks' if s.get('array') is not None else 'trials'} queued as jobs {jobs}")
    if sweep.get("reason"):
        _say(f"  {sweep['reason']}")
    _say(_text(f"  `ddpq sweep status {sweep['id']}` shows its trials, ranked", style="dim"))


def sweep_aim(spec: dict[str, Any]) -> str:
    """ ", minimize loss", or nothing for a sweep without a metric."""
    return f", {spec['direction']} {spec['metric']}" if spec.get("metric") else ""


def _never_runs(job: dict[str, Any]) -> bool:
    """A queued job no registered worker could ever run (the API says so in its reason)."""
    return job["status"] == "queued" and is_unschedulable(job.get("reason"))


# Options may follow the job's id; program arguments come after --.
@client_command()
def resubmit(
    job_id: int,
    args: Args = None,
    world_size: WorldSize = None,
    nnodes: Nnodes = None,
    name: Name = None,
    device: Device = None,
    priority: Priority = None,
    max_attempts: MaxAttempts = None,
    max_restarts: MaxRestarts = None,
    retry_on_error: RetryOnError = None,
    timeout_s: TimeoutS = None,
    keep_last: KeepLast = None,
    launcher: Launcher = None,
    env: EnvOpt = None,
    pip: PipOpt = None,
    secret: SecretOpt = None,
    after: AfterOpt = None,
    from_checkpoint: ForkOpt = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="run on from where the job stopped, however it ended: from its newest "
            "kept checkpoint, in a copy of its directory as it ended (what it wrote there "
            "included), not in its original code",
        ),
    ] = False,
    wait: Wait = False,
    strict: Strict = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a job's program again.

    The same code and spec, with these flags overriding it ([-- ARGS...] replaces its
    arguments). It says which snapshot it reruns and, run in the job's own directory
    (the one holding its entrypoint), whether the files here differ from it.
    --resume runs on from its newest kept checkpoint (fetched from the worker that
    holds it), in a copy of the job's directory as it ended.
    """
    flags = {k: v for k, v in locals().items() if k in SPEC_FLAGS}
    with _client() as c:
        old = c.job(job_id)
        spec = {k: v for k, v in old["spec"].items() if v is not None}
        if resume:
            code, words, checkpoint = _resume_from(c, old)
            if code is not None:
                spec["code"] = code
            spec.pop("from_checkpoint", None)
            if checkpoint is not None:
                spec["from_checkpoint"] = {"job": job_id, "step": checkpoint}
        elif spec.get("code") and not old.get("code"):
            _fail(
                f"job {job_id}'s code is no longer kept (collected after its retention "
                "period); submit it again from its directory",
                EXIT_API,
            )
        else:
            words = _rerun_words(c, old)
    _override(spec, flags, args, env, pip, secret, after)
    if from_checkpoint is not None:
        if resume:
            _fail("give --resume or --from-checkpoint, not both", EXIT_USAGE)
        spec["from_checkpoint"] = _fork(from_checkpoint)
    if as_json and words:  # stdout is for the Job
        err.print(_text(words), highlight=False, soft_wrap=True)
    _submit(spec, None, wait, strict, as_json, None, words)


def _resume_from(c: Client, old: dict[str, Any]) -> tuple[str | None, str, int | None]:
    """What a resume of ``old`` runs on: the snapshot of its directory as its last
    attempt left it (None: its code as it was), the words that say so (docs/outputs.md),
    and the step of its newest kept checkpoint, which the new job starts from (None:
    it kept none)."""
    job_id = old["id"]
    kept = [ck["step"] for ck in c.checkpoints(job_id) if ck.get("state") == "kept"]
    step = max(kept) if kept else None
    start = f"; it starts from its checkpoint at step {step}" if step is not None else ""
    outs = c.outputs(job_id)
    if outs["directory"] is None:
        why = (
            "it ran no code of its own (a recipe, or --no-code)"
            if not old["spec"].get("code")
            else "no attempt of it ended on a worker that sent it, or it was collected "
            "after its retention (DDPQ_WORKDIR_RETENTION)"
        )
        if step is None:
            _fail(f"job {job_id} left no directory to resume in, nor a checkpoint: {why}", EXIT_API)
        return None, f"resuming job {job_id} in its code as it was ({why}){start}", step
    wrote = [i for i in outs["items"] if i.get("symlink") is None]
    words = (
        f"resuming in a copy of job {job_id}'s directory as attempt {outs['attempt']} left "
        f"it: its code and {file_count(len(wrote))} it wrote ({human_bytes(outs['bytes'])})"
    )
    if outs["left"]:
        named = ", ".join(f"{x['path']} ({x['why']})" for x in outs["left"][:5])
        words += f"; not carried: {named}"
    return str(outs["directory"]), words + start, step


def _rerun_words(c: Client, old: dict[str, Any]) -> str:
    """Which snapshot a resubmit reruns, and, when run in the job's own directory (it
    holds the entrypoint), whether the files here differ from it (an edited
    train.py was not what ran, and nothing said so)."""
    snap = old.get("code")
    if not snap:
        return ""
    words = (
        f"rerunning job {old['id']}'s code {snap['id'][:12]} as it was sent "
        f"({file_count(snap['files'])}, {human_bytes(snap['bytes'])})"
    )
    entrypoint = old["spec"].get("entrypoint")
    if not entrypoint or not Path(entrypoint).is_file():
        return words
    try:
        here = {e.path: e for e in codepack.hashed(codepack.collect(Path(".")))}
    except (CodeError, OSError):
        return words
    sent = {e["path"]: e for e in c.code(snap["id"])["manifest"]}
    diff = _differences(sent, here)
    if not diff:
        return words + "; the files here are the same"
    more = f" and {len(diff) - 5} more" if len(diff) > 5 else ""
    return (
        f"{words}; the files here differ from it: {', '.join(diff[:5])}{more} "
        "(`ddpq submit` sends them)"
    )


def _differences(sent: dict[str, dict[str, Any]], here: dict[str, Any]) -> list[str]:
    out = []
    for path in sorted(set(sent) | set(here)):
        a, b = sent.get(path), here.get(path)
        if a is None:
            out.append(f"{path} (new here)")
        elif b is None:
            out.append(f"{path} (not here)")
        elif (a.get("digest"), a.get("symlink")) != (b.digest, b.symlink):
            out.append(f"{path} (changed)")
    return out
