"""A job's Python requirements, judged before anything is installed: what each line of
the requirements.txt at the top of its code and each entry of its spec's ``pip`` list
asks for, whether this worker's policy allows it, the key of the environment that
installs them (by what is installed, not by how it is written), and the requirements
file the worker writes for pip. Pure: it reads the job's files (through worker.starting.reqfiles,
which opens and hashes them), starts no process and opens no connection.

Each requirement is one of these kinds:

- ``name``: a project name with optional extras, version specifiers and markers (PEP 508
  without a URL), e.g. ``numpy>=1.26; python_version < "3.12"``. Always allowed.
- ``path``: a file or directory inside the job's code (a relative path is relative to
  the top of the code), e.g. ``./wheels/x-0.1-py3-none-any.whl``. pip's rule decides what
  is a path: the text holds a ``/``, starts with ``.`` or ends like an archive (``.whl``,
  ``.tar.gz``, ...). It must exist, as a regular file or a directory, and stay inside the
  code with every link followed (a directory's links too). Always allowed.
- ``path-outside``: a path that leaves the job's code (absolute, ``..``, or through a
  link), or a directory holding a link that does.
- ``url``: a direct reference (``pkg @ https://...``) or a bare or VCS URL
  (``https://host/x.whl``, ``git+https://...``).
- ``option``: a line starting with ``-`` (``--index-url``, ``-e``, ``-r``, ``-c``,
  ``--find-links``, ``--trusted-host``, ``--pre``, ...), or a requirement followed by
  pip options other than ``--hash`` (``pkg --config-settings=...``).

An operator allows the last three with ``Policy.parse`` (``--pip-allow url``...), with
what each brings: ``option`` lets a job's pip read any file or index the worker can
reach (``-r /elsewhere``, ``-f``, ``--index-url``; pip may quote what it reads in the
job's log), ``path-outside`` lets it install any file the worker can read. Whatever the
policy, some lines are refused, since no pip run could make sense of them or they would
do more than they say: text that is not a requirement; a path that does not exist or is
neither a file nor a directory; a control character; ``${NAME}``, which pip replaces
with the worker's environment variable (``PIP_INDEX_URL`` may hold a password) in any
requirements file, so also in the one the worker writes.

``--hash`` after a name or a path is allowed (it is kept, in the key as well): it only
makes pip stricter (every requirement then needs a hash, pip's hash-checking mode).

The environment's key (``basis``) is what is installed: names normalised (PEP 503 names,
sorted extras and specifiers, markers as packaging writes them), a file by its name and
sha256, a directory by a digest of its tree; never where a path is, nor comments, order
or duplicates. URLs and options count as written.

The user's requirements.txt is read without following a link (a link could show a
file of the worker's in the job's log through pip's messages) and never given to pip:
the worker writes a file of its own from ``pip_lines`` (names as parsed, paths as
absolute paths in the job's directory, allowed URLs and options as written).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import InvalidMarker, Marker
from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as Pep508
from packaging.utils import canonicalize_name

from ddpq.errors import RequirementsRefused
from ddpq.rules import unsafe_char, visible
from worker.starting import reqfiles

FILE = "requirements.txt"
KINDS = ("name", "path", "url", "option", "path-outside")
ALWAYS = frozenset({"name", "path"})
MAX_FILE_BYTES = 1_000_000  # requirements.txt
MAX_REQUIREMENTS = 1000  # requirements.txt's and pip's together
QUOTED_CHARS = 200  # of a user's text quoted in a refusal

# pip's own rules for a requirements file (pip._internal.req.req_file, req_install).
_COMMENT = re.compile(r"(^|\s+)#.*$")
_ENV_VAR = re.compile(r"\$\{[A-Z0-9_]+\}")
_OPTIONS = re.compile(r"(^|\s)-")  # where options start: a word starting with "-"
_EXTRAS = re.compile(r"(.+)(\[[^\]]+\])")
_ARCHIVES = (
    ".tar.bz2", ".tbz", ".tar.xz", ".txz", ".tlz", ".tar.lz", ".tar.lzma", ".zip", ".whl",
    ".tar.gz", ".tgz", ".tar",
)  # fmt: skip
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # a name never has ":" after it
_DIRECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\s*(\[[^\]]*\])?\s*@")
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_HASH_HEX = {"sha256": 64, "sha384": 96, "sha512": 128}

_ALLOW_HINT = {
    "url": "an operator can allow URLs with --pip-allow url",
    "option": "an operator can allow pip options with --pip-allow option",
    "path-outside": (
        "an operator can allow paths outside the job's code with --pip-allow path-outside"
    ),
}


@dataclass(frozen=True)
class Policy:
    """The kinds of requirement this worker installs (``name`` and ``path`` always)."""

    allowed: frozenset[str] = ALWAYS

    def __post_init__(self) -> None:
        if not ALWAYS <= self.allowed <= set(KINDS):
            raise ValueError(f"a policy allows name, path and some of {', '.join(KINDS[2:])}")

    @classmethod
    def parse(cls, values: Iterable[str]) -> Policy:
        """The policy of the worker's ``--pip-allow`` values: each a kind, or several
        separated by commas. ValueError names an unknown one (the caller names the
        option: "--pip-allow: 'urls' is not a kind of requirement: choose from ...")."""
        allowed = set(ALWAYS)
        for value in values:
            for word in value.split(","):
                kind = word.strip().lower()
                if kind not in KINDS:
                    raise ValueError(
                        f"{_quote(word)} is not a kind of requirement: choose "
                        "from url (direct and VCS URLs), option (pip options such as "
                        "--index-url or -r), path-outside (files outside the job's code)"
                    )
                allowed.add(kind)
        return cls(frozenset(allowed))

    def installs(self) -> str:
        """What the worker installs, in words: 'project names ... and files ...'."""
        parts = []
        if "name" in self.allowed:
            parts.append("project names with version specifiers")
        if "url" in self.allowed:
            parts.append("URLs")
        if "option" in self.allowed:
            parts.append("pip options")
        if "path-outside" in self.allowed:
            parts.append("local files")
        elif "path" in self.allowed:
            parts.append("files inside the job's code")
        listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
        return f"this worker installs only {listed}"


DEFAULT = Policy()


@dataclass(frozen=True)
class Requirement:
    """One requirement as judged: ``line`` is what the worker's requirements file says
    for it, ``key`` its part of the environment's basis."""

    where: str  # "requirements.txt line 3", "pip[0]"
    text: str  # as written (one logical line, its comment removed)
    kind: str  # one of KINDS
    line: str
    key: str
    path: Path | None = None  # a path's file or directory here, links resolved
    digest: str | None = None  # sha256 of that file, or of that directory's tree


def read(job_dir: Path | None, pip: Sequence[str], policy: Policy = DEFAULT) -> list[Requirement]:
    """The requirements of a job: requirements.txt at the top of its code (``job_dir``;
    None for a job without code, whose paths cannot be relative), then its spec's pip
    list. Raises RequirementsRefused on the first that breaks ``policy`` or cannot be read."""
    items: list[tuple[str, str]] = []
    if job_dir is not None:
        text = read_file(job_dir)
        if text is not None:
            items += [(f"{FILE} line {n}", line) for n, line in logical_lines(text)]
    for i, entry in enumerate(pip):
        where = f"pip[{i}]"
        if not isinstance(entry, str):
            raise RequirementsRefused(
                f"{where}: a requirement is a string, not {type(entry).__name__}"
            )
        if "\n" in entry or "\r" in entry or entry.rstrip().endswith("\\"):
            raise RequirementsRefused(
                f"{where}: {_quote(entry)} is not one line (a line break, or a backslash at "
                "its end, which continues it); write one requirement"
            )
        if _COMMENT.search(entry):
            raise RequirementsRefused(
                f"{where}: {_quote(entry)} holds a comment (' #'); write the requirement alone"
            )
        items.append((where, entry.strip()))
    if len(items) > MAX_REQUIREMENTS:
        raise RequirementsRefused(
            f"{FILE} and pip hold {len(items)} requirements, more than {MAX_REQUIREMENTS}"
        )
    judge = _Judge(job_dir, policy)
    return [judge(where, text) for where, text in items]


def basis(reqs: Iterable[Requirement]) -> list[str]:
    """What the environment's key is made of: each requirement's key (names normalised,
    paths by their content and file name), sorted, each once. JSON-able."""
    return sorted({r.key for r in reqs})


def pip_lines(reqs: Iterable[Requirement]) -> list[str]:
    """The lines of the requirements file the worker writes and gives pip (``-r``), in
    the order written, each once."""
    return list(dict.fromkeys(r.line for r in reqs))


def read_file(job_dir: Path) -> str | None:
    """The text of requirements.txt at the top of ``job_dir``, or None when there is
    none. Opened in the directory without following a link (worker.starting.reqfiles); refused
    when it is a link, not a regular file, over MAX_FILE_BYTES or not UTF-8."""
    try:
        return reqfiles.read_text(job_dir, FILE, MAX_FILE_BYTES)
    except reqfiles.Unreadable as e:
        raise RequirementsRefused(f"{FILE} {e}") from None


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Each requirement of a requirements file's text, as pip reads it, with the number
    of its first line: a line ending with a backslash joined to the next, comments
    (``#`` at the start or after a space) removed, blank lines left out."""
    out: list[tuple[int, str]] = []

    def emit(number: int, line: str) -> None:
        line = _COMMENT.sub("", line).strip()
        if line:
            out.append((number, line))

    pending: list[str] = []
    first = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.endswith("\\") or _COMMENT.match(line):
            if _COMMENT.match(line):
                line = " " + line  # a comment ends a continued line, and is removed
            if pending:
                emit(first, "".join([*pending, line]))
                pending = []
            else:
                emit(number, line)
        else:
            if not pending:
                first = number
            pending.append(line.strip("\\"))
    if pending:
        emit(first, "".join(pending))
    return out


class _Judge:
    """Classifies requirements against a policy; the digests of paths are made once."""

    def __init__(self, job_dir: Path | None, policy: Policy) -> None:
        self.job_dir = job_dir
        self.root = os.path.realpath(job_dir) if job_dir is not None else None
        self.policy = policy
        # A file's or tree's digest, and whether the tree leaves the job's code.
        self.digests: dict[tuple[str, bool], tuple[str, bool]] = {}

    def __call__(self, where: str, text: str) -> Requirement:
        said = f"{where}: {_quote(text)}"
        if unsafe_char(text.replace("\t", " ")):
            raise RequirementsRefused(f"{said} holds a control character")
        if _ENV_VAR.search(text):
            raise RequirementsRefused(
                f"{said} names an environment variable (${{...}}), which pip would replace "
                "with the worker's own; write the value itself"
            )
        if text.startswith("-"):
            return self._as_given(where, text, "option", f"{said} is a pip option")
        cut = _OPTIONS.search(text)
        args, options = (text[: cut.start()].strip(), text[cut.start() :]) if cut else (text, "")
        hashes = _hashes(options, said)
        if hashes is None:
            why = f"{said} carries pip options ({_quote(options.strip())})"
            return self._as_given(where, text, "option", why)
        if _DIRECT.match(args):
            return self._as_given(where, text, "url", f"{said} is a direct URL")
        if _SCHEME.match(args):
            return self._as_given(where, text, "url", f"{said} is a URL")
        spec, _, marker = args.partition(";")
        spec = spec.strip()
        m = _EXTRAS.fullmatch(spec)
        path, extras = (m.group(1), m.group(2)) if m else (spec, "")
        if "/" in path or path.startswith(".") or path.lower().endswith(_ARCHIVES):
            tail = _extras(extras, said) + _marker(marker.strip(), said)
            return self._path(where, text, said, path, tail + _hash_options(hashes))
        return self._name(where, text, said, args, hashes)

    def _as_given(self, where: str, text: str, kind: str, why: str) -> Requirement:
        """A URL or an option: passed on as written, when allowed."""
        self._check(kind, why)
        return Requirement(where=where, text=text, kind=kind, line=text, key=f"{kind} {text}")

    def _check(self, kind: str, why: str) -> None:
        if kind not in self.policy.allowed:
            raise RequirementsRefused(f"{why}; {self.policy.installs()} ({_ALLOW_HINT[kind]})")

    def _name(self, where: str, text: str, said: str, args: str, hashes: list[str]) -> Requirement:
        try:
            req = Pep508(args)
        except InvalidRequirement as e:
            raise RequirementsRefused(
                f"{said} is not a requirement: {str(e).splitlines()[0]} (write a project "
                "name with optional extras, version specifiers and markers, like "
                "'numpy>=1.26', or a path inside the job's code, like './wheels/x.whl')"
            ) from None
        if req.url:  # _DIRECT saw these first; kept for a form it did not
            return self._as_given(where, text, "url", f"{said} is a direct URL")
        line: str = canonicalize_name(req.name)
        if req.extras:
            line += "[" + ",".join(sorted({canonicalize_name(x) for x in req.extras})) + "]"
        line += str(req.specifier)
        if req.marker is not None:
            line += f"; {req.marker}"
        line += _hash_options(hashes)
        return Requirement(where=where, text=text, kind="name", line=line, key=f"name {line}")

    def _path(self, where: str, text: str, said: str, written: str, tail: str) -> Requirement:
        """A file or directory: named to pip by its absolute path here (its directory's
        links resolved, its own name kept: pip reads a wheel's name), keyed by content."""
        if os.path.isabs(written):
            candidate = written
        elif self.job_dir is None:
            raise RequirementsRefused(
                f"{said} is a path relative to the job's code, and this job has no code "
                "(submit it with its code, or name a project instead)"
            )
        else:
            candidate = os.path.join(self.job_dir, written)
        real = os.path.realpath(candidate)
        name = os.path.basename(candidate)
        parent = os.path.realpath(os.path.dirname(candidate))
        kind = "path"
        if not (self._inside(real) and self._inside(parent)):
            kind = "path-outside"
            lexical = self.root is not None and self._inside(
                os.path.normpath(os.path.join(self.root, written))
            )
            how = "leads outside the job's code through a link" if lexical else "is outside"
            self._check(kind, f"{said} {how}" + ("" if lexical else " the job's code"))
        try:
            mode = os.stat(real).st_mode
        except OSError:
            if kind == "path-outside":
                raise RequirementsRefused(f"{said} does not exist on this worker") from None
            raise RequirementsRefused(
                f"{said} does not exist in the job's code (a path is relative to the top of "
                "the job's code; was it left out by a .ddpqignore or .gitignore?)"
            ) from None
        if stat.S_ISREG(mode):
            here = os.path.join(parent, name) if name not in ("", ".", "..") else real
            digest, _ = self._digest(said, real, tree=False)
            key = f"file {name} sha256:{digest}"
        elif stat.S_ISDIR(mode):
            here = real
            digest, leaves = self._digest(said, real, tree=True)
            if leaves:
                kind = "path-outside"
            key = f"tree sha256:{digest}"
        else:
            raise RequirementsRefused(
                f"{said} is {reqfiles.file_type(mode)}, neither a file nor a directory"
            )
        problem = _line_problem(here)
        if problem:
            raise RequirementsRefused(
                f"{said}: its place on this worker, {_quote(here)}, {problem}, which a "
                "requirements file cannot name (tell the worker's operator)"
            )
        return Requirement(
            where=where,
            text=text,
            kind=kind,
            line=here + tail,
            key=key + tail,
            path=Path(here),
            digest=digest,
        )

    def _inside(self, real: str) -> bool:
        return self.root is not None and Path(real).is_relative_to(self.root)

    def _digest(self, said: str, real: str, *, tree: bool) -> tuple[str, bool]:
        """The sha256 of a file, or of a directory's tree, and whether that tree leaves
        the job's code through a link (refused unless the policy allows paths outside)."""
        done = self.digests.get((real, tree))
        if done is not None:
            return done
        try:
            if tree:
                follow_out = "path-outside" in self.policy.allowed
                digest, leaves = reqfiles.tree_digest(real, self.root, follow_out)
                done = (digest, bool(leaves))
            else:
                done = (reqfiles.file_digest(real), False)
        except reqfiles.LinkOut as e:
            why = f"{said} holds a link that leads outside the job's code ({_quote(str(e))})"
            self._check("path-outside", why)
            raise  # not reached: LinkOut is raised only when paths outside are refused
        except reqfiles.TooBig as e:
            raise RequirementsRefused(f"{said} holds {e}, too much to hash") from None
        except OSError as e:
            where = f" ({_quote(str(e.filename))})" if e.filename else ""
            raise RequirementsRefused(f"{said} cannot be read: {e.strerror}{where}") from None
        self.digests[(real, tree)] = done
        return done


def _extras(extras: str, said: str) -> str:
    """A path's extras (``[a,b]``), checked and normalised."""
    if not extras:
        return ""
    names = [x.strip() for x in extras[1:-1].split(",")]
    if not all(_NAME.fullmatch(x) for x in names):
        raise RequirementsRefused(f"{said} has extras that are not names ({_quote(extras)})")
    return "[" + ",".join(sorted({canonicalize_name(x) for x in names})) + "]"


def _marker(marker: str, said: str) -> str:
    """A path's environment marker (``; python_version < "3.12"``), checked and normalised."""
    if not marker:
        return ""
    try:
        return f"; {Marker(marker)}"
    except InvalidMarker as e:
        raise RequirementsRefused(
            f"{said} has a marker that is not one: {str(e).splitlines()[0]}"
        ) from None


def _hash_options(hashes: list[str]) -> str:
    return "".join(f" --hash={h}" for h in hashes)


def _hashes(options: str, said: str) -> list[str] | None:
    """The ``--hash`` values of a requirement's options, normalised and sorted; None
    when the options hold anything else (the line is then an option)."""
    words = options.split()
    found: set[str] = set()
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--hash" and i + 1 < len(words):
            value, i = words[i + 1], i + 2
        elif word.startswith("--hash="):
            value, i = word.removeprefix("--hash="), i + 1
        else:
            return None
        alg, _, hexdigest = value.partition(":")
        n = _HASH_HEX.get(alg.lower())
        if n is None or not re.fullmatch(f"[0-9a-fA-F]{{{n}}}", hexdigest):
            raise RequirementsRefused(
                f"{said} has a hash pip would not check ({_quote(value)}; write "
                "--hash=sha256:<64 hex digits>)"
            )
        found.add(f"{alg.lower()}:{hexdigest.lower()}")
    return sorted(found)


def _line_problem(path: str) -> str | None:
    """Why an absolute path cannot be a line of a requirements file that pip reads as
    that path, or None."""
    if unsafe_char(path) or "\t" in path:
        return "holds a control character"
    if ";" in path or _ENV_VAR.search(path) or re.search(r"\s[#-]", path):
        return "holds ';', '${', ' #' or ' -'"
    if path.endswith(("]", "\\")) or path != path.strip():
        return "ends with ']', a backslash or a space"
    return None


def _quote(text: str) -> str:
    """A user's text for a message: escaped where unsafe, cut at QUOTED_CHARS."""
    shown = visible(text)
    if len(shown) > QUOTED_CHARS:
        shown = shown[:QUOTED_CHARS] + "..."
    return f"'{shown}'"
