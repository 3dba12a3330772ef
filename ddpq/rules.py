"""What a job spec may ask of a worker: the rules the API checks at submission and
the worker checks again before it starts anything (it never trusts what it is sent),
and which characters must never reach a terminal as they are (the API refuses them in
names; the CLI shows them escaped).

Pure functions on strings, no imports of service/ or worker/: both import this.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

# Metric reports: what the API accepts in one point and one request. ddpq.train checks
# a point where report() is called, so a bad one never rides in a batch with good ones.
MAX_STEP = 2**63 - 1
MAX_METRIC_NAMES = 100  # values in one point
MAX_METRIC_ITEMS = 1000  # points in one request
MAX_NAME_CHARS = 200

# The first word of the reason of a queued job that no registered worker could ever
# run: the API writes it (service/queue/reasons.py), `ddpq submit --wait` stops on it.
UNSCHEDULABLE = "unschedulable"


def is_unschedulable(reason: str | None) -> bool:
    return reason is not None and reason.startswith(UNSCHEDULABLE + ":")


def metric_name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        return f"a metric name has 1 to {MAX_NAME_CHARS} characters, not {name!r}"
    if not name.isprintable():
        return f"a metric name has printable characters only (no control or format ones): {name!r}"
    return None


def total_steps_problem(total: object) -> str | None:
    """What is wrong with a job's ``total_steps`` (its progress bar's end), or None."""
    if isinstance(total, bool) or not isinstance(total, numbers.Integral):
        return f"total_steps must be an int, not {type(total).__name__}"
    if not 1 <= int(total) <= MAX_STEP:
        return f"total_steps must be between 1 and 2**63 - 1, not {total}"
    return None


def metric_point_problem(
    step: object, names: Iterable[object], *, with_total: bool = False
) -> str | None:
    """What is wrong with a point at ``step`` with values named ``names``, or None.
    A point that carries a total_steps (``with_total``) may have no values."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        return f"step must be an int, not {type(step).__name__}"
    if not 0 <= int(step) <= MAX_STEP:
        return f"step must be between 0 and 2**63 - 1, not {step}"
    names = list(names)
    if not names and not with_total:
        return "a point needs at least one metric, e.g. report(step, loss=...)"
    if len(names) > MAX_METRIC_NAMES:
        return f"at most {MAX_METRIC_NAMES} metrics in one point, not {len(names)}"
    for name in names:
        problem = metric_name_problem(name)
        if problem:
            return problem
    return None


# A job's program runs whatever code its author wrote, so the denylist does not try
# to stop a job from harming itself. It protects what ddpq promises around the job:
# - ddpq's own variables (the job token, the checkpoint directory, the launch id that
#   finds the ranks to kill): DDPQ_*;
# - the rank layout and rendezvous torchrun sets up: RANK, WORLD_SIZE, MASTER_*, ...,
#   TORCHELASTIC_*, and PET_*, which torchrun reads as defaults for its own options
#   (PET_RDZV_ENDPOINT would join another job's rendezvous);
# - the GPUs the job was given: *_VISIBLE_DEVICES, and CUDA_DEVICE_ORDER, which
#   renumbers devices so that the same indices name other cards;
# - the supervisor and torchrun itself, which start before the program and run with
#   this environment: the dynamic loader (LD_*, GLIBC_TUNABLES), the interpreter
#   (PYTHON*: PYTHONPATH could replace torch.distributed.run), PATH, HOME, and
#   BASH_ENV/ENV (read by any shell a library spawns).
# Left to the job on purpose: OMP_NUM_THREADS (torchrun only defaults it to 1, tuning
# it is normal), NCCL_* and TORCH_NCCL_* (transport tuning and debugging, as the seeds
# do, e.g. NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME), CUDA_LAUNCH_BLOCKING and the like.
RESERVED_ENV_PREFIXES = (
    "DDPQ_",
    "PET_",
    "TORCHELASTIC_",
    "TORCH_ELASTIC_",
    "MASTER_",
    "ROLE_",
    "LD_",
    "PYTHON",
)
RESERVED_ENV_SUFFIXES = ("_VISIBLE_DEVICES",)
RESERVED_ENV_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "NODE_RANK",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",  # ddpq sets it (see worker/executors/runner.py)
        "CUDA_DEVICE_ORDER",
        "GPU_DEVICE_ORDINAL",
        "GLIBC_TUNABLES",
        "PATH",
        "HOME",
        "BASH_ENV",
        "ENV",
    }
)
# Matched with fullmatch: "$" would also match before a final newline ("PATH\n").
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


# Characters that act on a terminal, or on how text is laid out, instead of printing:
# C0 and C1 controls and DEL (Cc; ESC starts the sequences that retitle a window, clear
# the screen or set the clipboard), format characters (Cf: bidi overrides and isolates
# reorder what follows them, as in "Trojan Source"; zero-width ones hide text), line
# and paragraph separators (Zl, Zp) and lone surrogates (Cs). Other characters print as
# themselves, whatever the script: a name like "学習 テスト" is fine.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Printable ASCII is never unsafe: only the other characters need a look-up (a log is
# mostly ASCII, so escaping one costs a regex scan and a call per line).
_NOT_PLAIN_ASCII = re.compile(r"[^\x20-\x7e]")


def unsafe_char(text: str) -> str | None:
    """The first character of ``text`` that must not reach a terminal as it is, or None."""
    for m in _NOT_PLAIN_ASCII.finditer(text):
        if unicodedata.category(m.group()) in _UNSAFE_CATEGORIES:
            return m.group()
    return None


def visible(text: str, keep: str = "") -> str:
    """``text`` with every character ``unsafe_char`` finds, except those in ``keep``,
    written as a Python escape: ESC shows as \\x1b, U+202E as \\u202e."""

    def shown(m: re.Match[str]) -> str:
        c = m.group()
        if c in keep or unicodedata.category(c) not in _UNSAFE_CATEGORIES:
            return c
        n = ord(c)
        return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"

    return _NOT_PLAIN_ASCII.sub(shown, text)


def reserved_env(name: str) -> bool:
    """True for a variable a job's ``env`` must not set (compared case-insensitively)."""
    upper = name.upper()
    return (
        upper in RESERVED_ENV_NAMES
        or upper.startswith(RESERVED_ENV_PREFIXES)
        or upper.endswith(RESERVED_ENV_SUFFIXES)
    )


def env_problem(name: str, value: str) -> str | None:
    """Why ``name=value`` cannot go into a job's environment, or None."""
    if not ENV_NAME.fullmatch(name):
        return f"{name[:100]!r} is not a valid variable name"
    if reserved_env(name):
        return f"{name} is set by ddpq, torchrun or CUDA and cannot be overridden"
    if "\x00" in value:
        return f"the value of {name} contains a NUL character"
    return None


# Secrets (service/secrets.py; docs/sharing.md#secrets): a user's values that reach their
# jobs' ranks as environment variables and no answer, log or view. A name follows the rules
# of a spec's env (env_problem: a valid name, none ddpq, torchrun or CUDA sets). Bounded:
# every value a job names lands in its ranks' environment, which the kernel caps (128 KiB
# a string, about 2 MiB in all with the arguments).
MAX_SECRET_BYTES = 16 * 1024  # a value, UTF-8
MAX_JOB_SECRETS = 32  # names in one spec
MAX_USER_SECRETS = 200  # secrets one user keeps
# The names of plain `env` variables that look like they hold a secret (`ddpq submit`
# warns: a spec's env is shown to the whole team): *_KEY, *TOKEN*, *SECRET*, *PASSWORD*.
_SECRET_LIKE = re.compile(r".*_KEY|.*(TOKEN|SECRET|PASSWORD).*", re.IGNORECASE)
_SURROGATE = re.compile("[\ud800-\udfff]")


def secret_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a secret (the variable its value is given to the ranks
    as), or None."""
    return env_problem(name, "")


def secret_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a secret's value, or None (never quoting it)."""
    if not value:
        return "is empty"
    if "\x00" in value:
        return "contains a NUL character (an environment variable cannot hold one)"
    if _SURROGATE.search(value):
        return "is not valid UTF-8 text (it holds a lone surrogate)"
    size = len(value.encode("utf-8"))
    if size > MAX_SECRET_BYTES:
        return f"is {size} bytes; a secret's value is at most {MAX_SECRET_BYTES}"
    return None


def secret_like(name: str) -> bool:
    """Whether a plain ``env`` variable's name looks like it holds a secret."""
    return _SECRET_LIKE.fullmatch(name) is not None


# %2e %2f %5c %00 and the like: nothing decodes an entrypoint, so an encoded dot or
# slash is a sign of someone probing for a decoder; refuse it rather than guess.
_ENCODED = re.compile(r"%[0-9A-Fa-f]{2}")


def entrypoint_problem(path: str) -> str | None:
    """Why ``path`` is not a plain relative path inside a workspace, or None.

    Checked on the text and on its NFKC form (fullwidth dots and slash, U+FF0E and
    U+FF0F, become "../"), so no spelling of an absolute path or a parent step gets
    through. Symlinks can only be judged where the file is: the worker resolves the
    path before it runs it.
    """
    for form in (path, unicodedata.normalize("NFKC", path)):
        if unsafe_char(form) is not None:
            return "must not contain control, format or surrogate characters"
        if "\\" in form:
            return "must use '/' as the separator"
        if _ENCODED.search(form):
            return "must not contain %-encoded characters"
        if form.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", form):
            return "must be a path relative to the worker's workspace"
        parts = form.split("/")
        if ".." in parts:
            return "must not contain '..'"
        if all(p in ("", ".") for p in parts):
            return "must name a file inside the workspace"
    return None


# A trial's parameters (a sweep's: docs/experiments.md): a spec's ``params``, which the
# API checks at submission and the worker again before it gives them to the ranks as
# JSON in DDPQ_PARAMS, where ``params()`` reads them. Names are those a template writes
# (``--lr {lr}``); values JSON scalars, bounded so that the variable fits every rank's
# environment (64 of 500 characters: about 35 KB, of the kernel's 128 KiB a string).
PARAMS_VAR = "DDPQ_PARAMS"
MAX_PARAMS = 64
MAX_PARAM_TEXT = 500
PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # fullmatch
INT64 = (-(2**63), 2**63 - 1)


def param_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a parameter, or None."""
    if isinstance(name, str) and PARAM_NAME.fullmatch(name):
        return None
    return (
        "a parameter's name is a letter or '_' and then up to 63 letters, digits or '_' "
        f"(as a template names it: {{lr}}), not {str(name)[:100]!r}"
    )


def param_value_problem(value: object) -> str | None:
    """Why ``value`` cannot be a parameter's value (a JSON scalar), or None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if INT64[0] <= value <= INT64[1] else "an integer must fit in 64 bits"
    if isinstance(value, float):
        return None if math.isfinite(value) else "a number must be finite"
    if isinstance(value, str):
        if len(value) > MAX_PARAM_TEXT:
            return f"a text value has at most {MAX_PARAM_TEXT} characters"
        return "a text value must not hold a NUL character" if "\x00" in value else None
    return f"a value is a string, a number, true, false or null, not {type(value).__name__}"


def params_problem(params: object) -> str | None:
    """Why ``params`` cannot be a job's parameters, or None."""
    if not isinstance(params, dict):
        return f"parameters are a mapping of names to values, not {type(params).__name__}"
    if len(params) > MAX_PARAMS:
        return f"at most {MAX_PARAMS} parameters, not {len(params)}"
    for name, value in params.items():
        problem = param_name_problem(name) or param_value_problem(value)
        if problem:
            return f"{str(name)[:100]}: {problem}"
    return None


def params(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This trial's parameters, as its sweep chose them: ``{"lr": 0.003, "width": 128}``
    (docs/experiments.md); ``{}`` in any other job, or outside ddpq. Every rank gets
    them. Offered as ``ddpq.train.params()`` and ``ddpq.params()``. (Reading the
    environment is the one thing here that is not a pure function of its arguments.)"""
    text = (os.environ if environ is None else environ).get(PARAMS_VAR)
    if not text:
        return {}
    found = json.loads(text)
    problem = params_problem(found)
    if problem:
        raise ValueError(f"{PARAMS_VAR}: {problem}")
    return dict(found)


# The steps at which a trial's sweep judges it (its early stopping's rungs): a spec's
# ``rungs``, which its sweep sets and its ranks read in DDPQ_RUNGS. The reporter
# (ddpq.train) sends a point that reaches one at once and asks for the judgment with it
# (POST /jobs/{id}/metrics?judge=true): a pruned trial stops within that request, not at
# the sweeps' next round and its worker's next heartbeat. The first MAX_RUNGS only; the
# sweeps' rounds judge any later ones all the same.
RUNGS_VAR = "DDPQ_RUNGS"
MAX_RUNGS = 64


def rungs_problem(rungs: object) -> str | None:
    """Why ``rungs`` cannot be a job's rungs (steps, ascending), or None."""
    if not isinstance(rungs, list) or len(rungs) > MAX_RUNGS:
        return f"rungs are a list of at most {MAX_RUNGS} steps"
    for i, step in enumerate(rungs):
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            return f"rungs[{i}]: a step is an integer from 0 to {MAX_STEP}"
        if i and step <= rungs[i - 1]:
            return f"rungs[{i}]: steps are in ascending order"
    return None


def rungs(environ: Mapping[str, str] | None = None) -> list[int]:
    """The steps at which this trial's sweep judges it (DDPQ_RUNGS); [] in any other job,
    or when the variable is not such a list (a judgment then waits for the sweeps' round)."""
    text = (os.environ if environ is None else environ).get(RUNGS_VAR, "")
    try:
        found = [int(t) for t in text.split(",") if t]
    except ValueError:
        return []
    return found if rungs_problem(found) is None else []


# A job array (docs/experiments.md): Slurm's ``--array`` syntax without its ``%N`` (the
# CLI turns that into the sweep's max_concurrent): "0-31", "0-15:4", "1,3,5-7". Each task
# is a trial of a sweep whose one parameter is ``index``, and its ranks read the index in
# DDPQ_ARRAY_INDEX. At most 1,000 tasks (Slurm's default MaxArraySize is 1,001), indices
# from 0 to 2**31 - 1, each once.
ARRAY_VAR = "DDPQ_ARRAY_INDEX"
MAX_ARRAY_TASKS = 1000
MAX_ARRAY_INDEX = 2**31 - 1
MAX_ARRAY_CHARS = 2000
_ARRAY_ITEM = re.compile(r"(\d{1,10})(?:-(\d{1,10})(?::(\d{1,10}))?)?")  # fullmatch


def array_indices(text: str) -> list[int]:
    """The indices ``text`` names, ascending; ValueError saying which part is wrong."""
    if len(text) > MAX_ARRAY_CHARS:
        raise ValueError(f"at most {MAX_ARRAY_CHARS} characters")
    found: set[int] = set()
    for item in text.split(","):
        m = _ARRAY_ITEM.fullmatch(item.strip())
        if m is None:
            raise ValueError(
                f"{item.strip()[:40]!r} is not an index (7), a range (0-31) or a range "
                "with a step (0-31:2)"
            )
        low = int(m.group(1))
        high = int(m.group(2)) if m.group(2) is not None else low
        step = int(m.group(3)) if m.group(3) is not None else 1
        if high > MAX_ARRAY_INDEX:
            raise ValueError(f"{item.strip()}: an index is at most {MAX_ARRAY_INDEX}")
        if high < low:
            raise ValueError(f"{item.strip()}: a range goes up ({low} > {high})")
        if step < 1:
            raise ValueError(f"{item.strip()}: a step is at least 1")
        # Counted before it is made: "0-2147483647" must not make two billion numbers.
        if (high - low) // step + 1 > MAX_ARRAY_TASKS:
            raise ValueError(f"{item.strip()}: at most {MAX_ARRAY_TASKS} tasks")
        found.update(range(low, high + 1, step))
        if len(found) > MAX_ARRAY_TASKS:
            raise ValueError(f"at most {MAX_ARRAY_TASKS} tasks")
    return sorted(found)


def checkpoint_words(job_id: int, step: int) -> str:
    """A checkpoint as the API's reasons and the worker's log name it (a fork's)."""
    return f"job {job_id}'s checkpoint at step {step}"
