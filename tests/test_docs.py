"""The README and the documentation site say only what the code does.

- The generated pages (configuration, CLI, REST: docs/gen_reference.py) are what the
  generator writes now, so a setting, flag or route changed without `make docs` fails.
- Every ``DDPQ_*`` variable the README or a page names is a setting of the API or of a
  worker, or a variable the code reads (a string in its source, a compose or deploy file).
- Every ``ddpq COMMAND`` they name is a command of the CLI.
- Every REST path they name is a path of the API's OpenAPI document.
- The README stays a five-minute door: under 250 lines.

Cheap: no server, no subprocess; the OpenAPI document comes from an app built in-process.
(`make docs` builds the site itself with --strict: links, anchors, nav.)
"""

from __future__ import annotations

import functools
import importlib.util
import io
import re
import tokenize
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# Where the code that reads variables lives (Python sources: their string literals).
CODE_DIRS = ["service", "worker", "ddpq", "recipes", "bench", "tests"]
# Files that hand variables to the code: compose, deployment, CI and build files.
CONFIG_FILES = [
    "docker-compose.yml",
    "Dockerfile",
    "Makefile",
    ".ci/run",
    ".env.example",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "deploy").glob("*"))),
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests" / "compose").rglob("*.yml"))),
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests" / "compose").rglob("*.sh"))),
]
VAR = re.compile(r"\bDDPQ_[A-Z0-9_]*[A-Z0-9]\b")
# Routes that are not operations of the document: the dashboard's shell and the document.
NOT_OPERATIONS = {"/", "/openapi.json", "/static"}
# `ddpq submit`, `.venv/bin/ddpq users add`; not `from ddpq import`, `ddpq.train`, `ddpq-api`
COMMAND = re.compile(r"(?<![\w.-])(?<!from )(?<!import )ddpq ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?")


@functools.cache
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def written_pages() -> list[Path]:
    """README.md and the hand-written pages (the generated ones are checked by equality)."""
    generated = set(generator().PAGES)
    return [README, *(p for p in sorted(DOCS.glob("*.md")) if p.name not in generated)]


def code_spans(text: str) -> list[str]:
    """The fenced blocks and inline code of Markdown text: where commands and paths are."""
    fence = r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```"  # in a list item too, indented
    fenced = re.findall(fence, text, flags=re.S | re.M)
    prose = re.sub(fence, "", text, flags=re.S | re.M)
    # An inline span may run over a line break; a fenced block's comments are prose.
    code = [re.sub(r"(^|\s)#.*", "", block, flags=re.M) for block in fenced]
    return code + [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


@pytest.mark.parametrize("name", ["configuration.md", "cli.md", "rest.md"])
def test_the_generated_pages_are_what_the_code_says_now(name: str) -> None:
    build = generator().PAGES[name]
    committed = (DOCS / name).read_text()
    assert committed == build(), (
        f"docs/{name} is stale: run `make docs` (or python docs/gen_reference.py) and commit it"
    )


def _variables_in_python(path: Path) -> set[str]:
    """DDPQ_* names in a Python file's string literals (never its comments)."""
    found: set[str] = set()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return found
    for tok in tokens:
        if tok.type == tokenize.STRING or getattr(tokenize, "FSTRING_MIDDLE", -1) == tok.type:
            found |= set(VAR.findall(tok.string))
    return found


@functools.cache
def variables_the_code_reads() -> frozenset[str]:
    from service.config import Settings
    from worker.executors.settings import WorkerSettings, variable

    prefix = Settings.model_config.get("env_prefix", "")
    names = {f"{prefix}{field}".upper() for field in Settings.model_fields}
    # The worker's settings read theirs as the API's do (worker/executors/settings.py).
    names |= {var for field in WorkerSettings.model_fields if (var := variable(field))}
    for directory in CODE_DIRS:
        for path in (ROOT / directory).rglob("*.py"):
            if path.name == "test_docs.py":
                continue
            names |= _variables_in_python(path)
    for name in CONFIG_FILES:
        path = ROOT / name
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if not line.lstrip().startswith("#"):
                    names |= set(VAR.findall(line))
    return frozenset(names)


def test_every_variable_the_docs_name_is_one_the_code_reads() -> None:
    known = variables_the_code_reads()
    assert "DDPQ_LEASE_S" in known and "DDPQ_JOB_ID" in known  # the check sees both kinds
    unknown = {
        f"{page.relative_to(ROOT)}: {var}"
        for page in [*written_pages(), *(DOCS / n for n in generator().PAGES)]
        for var in VAR.findall(page.read_text())
        if var not in known
    }
    assert not unknown, f"variables no code reads: {sorted(unknown)}"


def _commands() -> dict[str, set[str]]:
    """Each command, with its subcommands (a group's)."""
    commands: dict[str, set[str]] = {}
    for line in generator().cli_commands():
        words = line.split()[1:]
        commands.setdefault(words[0], set())
        if len(words) > 1:
            commands[words[0]].add(words[1])
    return commands


def test_every_command_the_docs_name_exists() -> None:
    commands = _commands()
    assert {"submit", "watch", "users"} <= set(commands) and "add" in commands["users"]
    wrong = []
    for page in written_pages():
        for span in code_spans(page.read_text()):
            for command, sub in COMMAND.findall(span):
                if command not in commands:
                    wrong.append(f"{page.name}: ddpq {command}")
                elif commands[command] and sub and sub not in commands[command]:
                    wrong.append(f"{page.name}: ddpq {command} {sub}")
    assert not wrong, f"commands the CLI does not have: {sorted(set(wrong))}"


@functools.cache
def _root() -> Any:
    return generator()._root_command()


def _options(words: list[str]) -> set[str] | None:
    """The options of the command ``words`` names (``["users", "add"]``), or None."""
    command = _root()
    for word in words:
        command = getattr(command, "commands", {}).get(word)
        if command is None:
            return None
    return {opt for p in command.params for opt in [*p.opts, *p.secondary_opts]}


def test_every_option_the_docs_give_a_command_exists() -> None:
    """`ddpq submit --wait`, `ddpq ls -s queued`: each option is one of that command's
    (up to a bare `--`, after which the words are the program's)."""
    checked = 0
    wrong = []
    commands = _commands()
    for page in written_pages():
        for span in code_spans(page.read_text()):
            for line in span.splitlines() or [span]:
                for match in COMMAND.finditer(line):
                    command, sub = match.groups()
                    words = (
                        [command, sub] if sub and sub in commands.get(command, ()) else [command]
                    )
                    options = _options(words)
                    if options is None:
                        continue  # test_every_command_the_docs_name_exists says so
                    rest = re.split(r"\s(?:--|\||&&|;)(?:\s|$)", line[match.end() :] + " ")[0]
                    rest = rest.split("`")[0]  # a quoted command ends at its backquote
                    for opt in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", rest):
                        checked += 1
                        if opt not in options:
                            wrong.append(f"{page.name}: ddpq {' '.join(words)} {opt}")
    assert checked > 50, "the check found almost no options: its patterns are broken"
    assert not wrong, f"options the commands do not have: {sorted(set(wrong))}"


@functools.cache
def operations() -> list[tuple[str, re.Pattern[str]]]:
    doc: dict[str, Any] = generator().openapi()
    found = []
    for path, ops in doc["paths"].items():
        pattern = re.compile("^" + re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(path)) + "$")
        found += [(method.upper(), pattern) for method in ops]
    return found


def _exists(method: str | None, path: str) -> bool:
    # A fragment is the dashboard's route (/#/compare?jobs=1,2), in its page at /.
    path = path.split("#")[0].split("?")[0].rstrip(".,;:)")
    if path.rstrip("/") in NOT_OPERATIONS or path.startswith("/static/") or path == "/":
        return True
    return any((method is None or m == method) and p.match(path) for m, p in operations())


def test_every_rest_path_the_docs_name_exists() -> None:
    named = 0
    wrong = []
    for page in written_pages():
        text = page.read_text()
        for method, path in re.findall(r"\b(GET|POST|PUT|DELETE|PATCH) (/[^\s`'\"]*)", text):
            named += 1
            if not _exists(method, path):
                wrong.append(f"{page.name}: {method} {path}")
        for span in code_spans(text):
            # curl's URLs: $API/jobs/1, http://127.0.0.1:8000/jobs/1/logs?offset=0
            for path in re.findall(r"(?:\$API|https?://[\w.\-]+:\d+)(/[^\s'\"\\)]*)", span):
                named += 1
                if not _exists(None, path):
                    wrong.append(f"{page.name}: {path}")
    assert named > 20, "the check found almost no paths: its patterns are broken"
    assert not wrong, f"paths the API does not have: {sorted(set(wrong))}"


def test_the_readme_is_a_five_minute_door() -> None:
    lines = README.read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines: move the rest into docs/"
