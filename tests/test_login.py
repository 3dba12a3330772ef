"""`ddpq login`, the config file and where the CLI finds the API and its token (issue 27):
the order (flag, environment, config file, ./var/api-token), several servers, the
errors that name what was tried, and the people commands (`users`, `whoami`, `audit`).

The CLI runs as subprocesses with HOME and XDG_CONFIG_HOME in a test's own directory:
the config of whoever runs the tests is never read or touched. No job runs (no worker):
a submitted job stays queued. The CLI is what is tested here, so most tests share one
SQLite server; the issue's "login, then submit from outside the checkout" runs on both
databases (a Postgres server of its own).
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import pty
import re
import stat
import subprocess
import sys
import termios
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ddpq import config
from tests.conftest import (
    NO_JOBS,
    Server,
    _child_env,
    free_port,
    run_ddpq,
    start_server,
    stop_process,
    stop_server,
    up_argv,
    wait_for,
)

USER_TOKEN = re.compile(r"^ddpqu_[A-Za-z0-9_-]{43}$", re.MULTILINE)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("login")
    s = start_server(f"sqlite:///{base / 'ddpq.db'}", base / "api")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server: two of them saved in one config file."""
    base = tmp_path_factory.mktemp("login-other")
    s = start_server(f"sqlite:///{base / 'ddpq.db'}", base / "api")
    yield s
    stop_server(s)


@pytest.fixture(params=["sqlite", "postgres"])
def each_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    """The module's SQLite server, or a server on Postgres started for the test alone."""
    if request.param == "sqlite":
        shared: Server = request.getfixturevalue("server")
        yield shared
        return
    s = start_server(request.getfixturevalue("pg_url"), tmp_path / "api")
    yield s
    stop_server(s)


class Home:
    """A user's home directory: their config file under it, the CLI run from it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.config = path / ".config" / "ddpq" / "config.toml"

    def env(self, **extra: str) -> dict[str, str]:
        return {"HOME": str(self.path), "XDG_CONFIG_HOME": str(self.path / ".config"), **extra}

    def ddpq(
        self, *args: str, input: str | None = None, cwd: Path | None = None, **env: str
    ) -> subprocess.CompletedProcess[str]:
        r = run_ddpq(*args, env=self.env(**env), cwd=cwd or self.path, input=input)
        assert "Traceback" not in r.stderr, r.stderr  # errors are sentences
        return r

    def login(self, server: Server, token: str | None = None, *args: str) -> str:
        r = self.ddpq("login", server.url, "--token-stdin", *args, input=token or server.api_token)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def saved(self) -> dict[str, Any]:
        with open(self.config, "rb") as f:
            return tomllib.load(f)

    def whoami(self, *args: str, **env: str) -> dict[str, Any]:
        r = self.ddpq(*args, "whoami", "--json", **env)
        assert r.returncode == 0, r.stderr
        who: dict[str, Any] = json.loads(r.stdout)
        return who


@pytest.fixture
def home(tmp_path: Path) -> Home:
    return Home(tmp_path / "home")


def _add_user(server: Server, name: str, role: str = "member") -> str:
    r = server.client().post("/users", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


# ---- login, then anywhere ------------------------------------------------------------------


def test_login_then_submit_and_ls_from_a_project_outside_the_checkout_with_no_environment(
    each_database: Server, home: Home, tmp_path: Path
) -> None:
    server = each_database
    project = tmp_path / "my-project"
    project.mkdir()
    (project / "train.py").write_text("print('hello')\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DDPQ_")}

    def ddpq(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        # No DDPQ_* variable at all, from a directory with no var/api-token near it.
        r = subprocess.run(
            [sys.executable, "-m", "ddpq.cli", *args],
            env={**clean, **home.env()},
            cwd=project,
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "Traceback" not in r.stderr, r.stderr
        return r

    # Before: the error says what it tried and that no token was found.
    r = ddpq("ls")
    assert r.returncode in (1, 3) and config.DEFAULT_URL in r.stderr, r.stderr
    assert "no token" in r.stderr or "none was found" in r.stderr, r.stderr

    r = ddpq("login", server.url, "--token-stdin", input=server.api_token + "\n")
    assert r.returncode == 0, r.stderr
    assert f"logged in to {server.url} as admin (admin)" in r.stdout
    assert 'server "default" in ~/.config/ddpq/config.toml' in r.stdout

    # Private: the file 0600, its directory 0700.
    assert stat.S_IMODE(home.config.stat().st_mode) == 0o600
    assert stat.S_IMODE(home.config.parent.stat().st_mode) == 0o700
    assert home.saved() == {
        "default": "default",
        "servers": {"default": {"url": server.url, "token": server.api_token}},
    }

    r = ddpq("submit", "--entrypoint", "train.py", "--name", "from-my-project", "--json")
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)
    assert job["status"] == "queued" and job["owner"] == "admin" and job["code"]
    r = ddpq("ls", "--name", "from-my-project", "--json")
    assert r.returncode == 0, r.stderr
    assert [j["id"] for j in json.loads(r.stdout)["items"]] == [job["id"]]
    r = ddpq("status", str(job["id"]))
    assert re.search(r"^\s+owner  admin$", r.stdout, re.MULTILINE), r.stdout
    assert ddpq("cancel", str(job["id"])).returncode == 0


def test_login_asks_for_the_token_on_the_terminal_without_echoing_it(
    server: Server, home: Home
) -> None:
    leader, follower = pty.openpty()

    def on_the_terminal() -> None:  # the pseudo-terminal is the command's own terminal
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpq.cli", "login", server.url],
        env=_child_env(home.env()),
        stdin=follower,
        stdout=follower,
        stderr=follower,
        cwd=home.path,
        preexec_fn=on_the_terminal,
    )
    os.close(follower)
    seen = b""

    def read() -> bytes:
        nonlocal seen
        try:
            seen += os.read(leader, 65536)
        except OSError:  # EIO: the command closed the terminal
            return b"EOF"
        return seen

    try:
        wait_for(lambda: b"token for " + server.url.encode() in read(), 30, "the prompt")
        os.write(leader, server.api_token.encode() + b"\n")
        while read() != b"EOF" and proc.poll() is None:
            pass
        assert proc.wait(30) == 0, seen
    finally:
        stop_process(proc)
        os.close(leader)
    assert b"logged in to" in seen and server.api_token.encode() not in seen, seen
    assert home.saved()["servers"]["default"]["token"] == server.api_token


def test_a_refused_token_or_an_unreachable_url_at_login_writes_nothing(
    server: Server, home: Home
) -> None:
    r = home.ddpq("login", server.url, "--token-stdin", input="not-a-token-of-anyone")
    assert r.returncode == 1 and "refused the token" in r.stderr and server.url in r.stderr
    assert "Nothing saved" in r.stderr
    nowhere = f"http://127.0.0.1:{free_port()}"
    r = home.ddpq("login", nowhere, "--token-stdin", input=server.api_token)
    assert r.returncode == 3 and nowhere in r.stderr and "Nothing saved" in r.stderr
    # The worker token is a token, but not a user's.
    r = home.ddpq("login", server.url, "--token-stdin", input=server.worker_token)
    assert r.returncode == 1 and "Nothing saved" in r.stderr
    for bad_input, why in (("", "no token"), ("two words", "not one word")):
        r = home.ddpq("login", server.url, "--token-stdin", input=bad_input)
        assert r.returncode == 2 and why in r.stderr, r.stderr
    r = home.ddpq("login", "127.0.0.1:8000", "--token-stdin", input=server.api_token)
    assert r.returncode == 2 and "http://HOST:PORT" in r.stderr
    r = home.ddpq("login", server.url, "--server", "no spaces", "--token-stdin", input="x")
    assert r.returncode == 2 and "cannot name a server" in r.stderr
    assert not home.config.parent.exists()

    # Logged in once, a refused login leaves the file as it was.
    home.login(server)
    before = home.config.read_bytes()
    r = home.ddpq("login", server.url, "--token-stdin", input="not-a-token-of-anyone")
    assert r.returncode == 1
    assert home.config.read_bytes() == before
    assert [p.name for p in home.config.parent.iterdir()] == ["config.toml"]  # no temp left


def test_two_servers_the_default_and_server_and_logout(
    server: Server, other: Server, home: Home
) -> None:
    home.login(server)
    out = home.login(other, None, "--server", "lab")
    assert 'saved as server "lab"' in out and 'the default server stays "default"' in out
    saved = home.saved()
    assert saved["default"] == "default" and set(saved["servers"]) == {"default", "lab"}

    assert home.whoami()["url"] == server.url
    lab = home.whoami("--server", "lab")
    assert lab["url"] == other.url and lab["server"] == "lab"
    assert lab["token_from"] == '~/.config/ddpq/config.toml, server "lab"'
    # After the command too, where login and logout take it.
    r = home.ddpq("--server", "lab", "submit", "--recipe", "toy-regression", "--name", "on-lab")
    assert r.returncode == 0, r.stderr
    names = [j["name"] for j in other.client().get("/jobs").json()["items"]]
    assert "on-lab" in names
    assert "on-lab" not in [j["name"] for j in server.client().get("/jobs").json()["items"]]

    # Logging in again to a URL keeps its name; --default moves the default.
    out = home.login(other, None, "--default")
    assert 'saved as server "lab"' in out and "it is the default server" in out
    assert home.saved()["default"] == "lab" and home.whoami()["url"] == other.url

    r = home.ddpq("--server", "nope", "ls")
    assert r.returncode == 2 and 'no server "nope"' in r.stderr and '"lab"' in r.stderr
    r = home.ddpq("--server", "lab", "--url", server.url, "ls")
    assert r.returncode == 2 and "not both" in r.stderr

    r = home.ddpq("logout", "--server", "lab")
    assert r.returncode == 0, r.stderr
    assert 'server "lab"' in r.stdout and "stays valid" in r.stdout
    # The one left becomes the default.
    assert home.saved() == {
        "default": "default",
        "servers": {"default": {"url": server.url, "token": server.api_token}},
    }
    assert stat.S_IMODE(home.config.stat().st_mode) == 0o600
    r = home.ddpq("--server", "lab", "ls")
    assert r.returncode == 2 and 'no server "lab"' in r.stderr
    # Saved under its HOST:PORT when "default" is taken by another URL.
    out = home.login(other)
    named = other.url.removeprefix("http://")
    assert f'saved as server "{named}"' in out
    assert home.ddpq("logout", "--server", named).returncode == 0
    r = home.ddpq("logout")
    assert r.returncode == 0 and 'server "default"' in r.stdout
    assert home.saved() == {}
    r = home.ddpq("logout")
    assert r.returncode == 2 and "not logged in" in r.stderr


# ---- the order -----------------------------------------------------------------------------


def test_flag_beats_environment_beats_config(server: Server, other: Server, home: Home) -> None:
    home.login(server)  # the default: server, with the admin's token
    alice = _add_user(other, "order-alice")

    who = home.whoami()
    assert (who["url"], who["name"]) == (server.url, "admin")
    assert who["token_from"] == who["url_from"] == '~/.config/ddpq/config.toml, server "default"'

    # The environment over the config file.
    env = {"DDPQ_URL": other.url, "DDPQ_TOKEN": alice}
    who = home.whoami(**env)
    assert (who["url"], who["name"]) == (other.url, "order-alice")
    assert (who["url_from"], who["token_from"]) == ("DDPQ_URL", "DDPQ_TOKEN")

    # Flags over the environment.
    who = home.whoami("--url", server.url, "--token", server.api_token, **env)
    assert (who["url"], who["name"]) == (server.url, "admin")
    assert (who["url_from"], who["token_from"]) == ("--url", "--token")
    who = home.whoami("--server", "default", **env)
    assert (who["url"], who["name"]) == (server.url, "admin")
    who = home.whoami("--token", server.api_token, DDPQ_URL=server.url)
    assert (who["url_from"], who["token_from"]) == ("DDPQ_URL", "--token")

    # A URL from the environment takes the token saved with it, and only that one: the
    # default server's token never goes to another URL.
    who = home.whoami(DDPQ_URL=server.url + "/")
    assert who["name"] == "admin" and who["token_from"].endswith('server "default"')
    r = home.ddpq("ls", DDPQ_URL=other.url)
    assert r.returncode == 1 and f"{other.url} wants a user token" in r.stderr, r.stderr

    # The legacy file next to a local server comes last, and goes only to the URL its
    # server wrote beside it: none written (a server from before), to none.
    var = home.path / "var"
    var.mkdir()
    (var / "api-token").write_text(alice + "\n")
    r = home.ddpq("ls", DDPQ_URL=other.url)
    assert r.returncode == 1 and "no api-url beside it" in r.stderr, r.stderr
    (var / "api-url").write_text(other.url + "\n")
    who = home.whoami(DDPQ_URL=other.url)
    assert who["name"] == "order-alice" and who["token_from"] == "~/var/api-token"
    assert home.whoami()["name"] == "admin"  # the config file's server first


def test_ddpq_port_stands_for_a_local_url(server: Server, home: Home) -> None:
    port = server.url.rsplit(":", 1)[1]
    who = home.whoami(DDPQ_PORT=port, DDPQ_TOKEN=server.api_token)
    assert (who["url"], who["url_from"]) == (server.url, "DDPQ_PORT")
    # DDPQ_URL, when set, is the URL.
    nowhere = f"http://127.0.0.1:{free_port()}"
    r = home.ddpq("ls", DDPQ_PORT=port, DDPQ_URL=nowhere, DDPQ_TOKEN=server.api_token)
    assert r.returncode == 3 and nowhere in r.stderr
    r = home.ddpq("ls", DDPQ_PORT="eighty")
    assert r.returncode == 2 and "DDPQ_PORT" in r.stderr


def test_errors_name_the_url_tried_and_where_the_token_came_from_in_one_line(
    server: Server, home: Home
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    cfg = config.Config(
        {"lab": config.Server(nowhere, "t" * 30), "here": config.Server(server.url, "wrong")},
        "lab",
        home.config,
    )
    config.save(cfg)
    for args in (["ls"], ["--server", "lab", "ls"], ["whoami"], ["users", "ls"]):
        r = home.ddpq(*args)
        assert r.returncode == 3, (args, r.stderr)
        line = r.stderr.strip()
        assert "\n" not in line, line
        assert line.startswith(f"error: cannot reach the ddpq API at {nowhere}"), line
        assert 'token from ~/.config/ddpq/config.toml, server "lab"' in line, line
    r = home.ddpq("--token", "t" * 30, "ls", DDPQ_URL=nowhere)
    assert r.returncode == 3 and "URL from DDPQ_URL; token from --token" in r.stderr

    # Refused: the URL, the API's reason, where the token came from, how to log in again.
    r = home.ddpq("--server", "here", "ls")
    assert r.returncode == 1
    line = r.stderr.strip()
    assert "\n" not in line and f"{server.url} refused the token: invalid token" in line, line
    assert 'token from ~/.config/ddpq/config.toml, server "here"' in line, line
    assert f"ddpq login {server.url} --server here" in line, line


def test_resolve_in_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ddpq.config.resolve without a server: each source, and what it is named."""
    for var in [v for v in os.environ if v.startswith("DDPQ_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    t = config.resolve()
    assert (t.url, t.token, t.url_from, t.token_from) == (
        config.DEFAULT_URL, None, "the built-in default", "no token"
    )  # fmt: skip
    monkeypatch.setenv("DDPQ_PORT", "8123")
    monkeypatch.setenv("DDPQ_HOST", "0.0.0.0")
    assert config.resolve().url == "http://127.0.0.1:8123"
    monkeypatch.setenv("DDPQ_HOST", "::1")
    assert config.resolve().url == "http://[::1]:8123"
    monkeypatch.delenv("DDPQ_HOST")
    monkeypatch.delenv("DDPQ_PORT")

    config.save(
        config.Config(
            {"a": config.Server("http://a:1", "ta"), "b": config.Server("http://b:2", "tb")},
            "a",
            config.config_path(),
        )
    )
    assert config.resolve() == config.Target(
        "http://a:1", "ta", config.load().where("a"), config.load().where("a"), "a"
    )
    assert config.resolve(server="b").token == "tb"
    # A token given alone goes with the built-in URL, never to the default server's.
    t = config.resolve(token="mine")
    assert (t.url, t.token) == (config.DEFAULT_URL, "mine")
    monkeypatch.setenv("DDPQ_TOKEN", "env")
    assert config.resolve().url == config.DEFAULT_URL
    assert config.resolve(server="b").token == "tb"  # a flag: before the environment
    monkeypatch.setenv("DDPQ_URL", "http://b:2/")
    assert (config.resolve().url, config.resolve().token) == ("http://b:2", "env")
    monkeypatch.delenv("DDPQ_TOKEN")
    assert config.resolve().token == "tb"  # saved with that URL
    monkeypatch.setenv("DDPQ_URL", "http://c:3")
    assert config.resolve().token is None
    # A local server's token file: only to the URL it wrote beside it (api-url).
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "api-token").write_text("legacy\n")
    t = config.resolve()
    assert t.token is None and "no api-url beside it" in (t.withheld or ""), t
    (tmp_path / "var" / "api-url").write_text("http://c:3\n")
    assert config.resolve().token == "legacy"
    assert config.resolve(url="http://c:3/").token == "legacy"  # its URL, from a flag too
    t = config.resolve(url="http://c:4")
    assert t.token is None and "sent only to http://c:3" in (t.withheld or ""), t
    # DDPQ_API_TOKEN, the server's setting: with the environment's own URL only.
    monkeypatch.setenv("DDPQ_DATA_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("DDPQ_API_TOKEN", "server-side")
    assert config.resolve().token_from == "DDPQ_API_TOKEN"
    t = config.resolve(url="http://c:4")
    assert t.token is None and "DDPQ_API_TOKEN goes only" in (t.withheld or ""), t

    with pytest.raises(config.ConfigError, match='no server "z"'):
        config.resolve(server="z")
    config.config_path().write_text("default = [\n")
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.resolve(server="a")
    # Flags and the environment that say everything need no config file at all.
    assert config.resolve(token="x").token == "x"


# ---- the file ------------------------------------------------------------------------------


def test_the_config_file_is_written_whole_private_and_escaped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    odd = 'a"b\\c\nd\te\x00f\x7fg é 🙂 [servers.x]'
    cfg = config.Config(
        {"lab": config.Server("http://lab:8000", odd), "127.0.0.1:8001": config.Server("u", "t")},
        "127.0.0.1:8001",
        config.config_path(),
    )
    old = os.umask(0)  # the mode comes from ddpq, not from the umask
    try:
        config.save(cfg)
    finally:
        os.umask(old)
    path = config.config_path()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with open(path, "rb") as f:
        data = tomllib.load(f)
    assert data["servers"]["lab"]["token"] == odd
    assert data["default"] == "127.0.0.1:8001"
    again = config.load()
    assert again.servers == cfg.servers and again.default == cfg.default

    # A link to the file (a dotfiles repository) is followed, not replaced.
    real = tmp_path / "dotfiles" / "ddpq.toml"
    real.parent.mkdir()
    path.rename(real)
    path.symlink_to(real)
    with config.editing() as edit:
        edit.servers.pop("lab")
    assert path.is_symlink() and "lab" not in config.load().servers
    assert stat.S_IMODE(real.stat().st_mode) == 0o600

    # `ddpq up`: "local", unless a "local" of another URL is there: kept, and said so.
    path.unlink()
    real.unlink()
    made = config.remember("http://127.0.0.1:9000", "t9", "local")
    assert (made.name, made.kept, made.default) == ("local", None, "local")
    made = config.remember("http://127.0.0.1:9001", "t91", "local")
    assert (made.name, made.kept, made.default) == (
        "127.0.0.1:9001", "http://127.0.0.1:9000", "local"
    )  # fmt: skip
    saved = config.load().servers["local"]
    assert saved == config.Server("http://127.0.0.1:9000", "t9", "ddpq up")
    made = config.remember("http://127.0.0.1:9001", "t91", "local")  # saved already: as is
    assert made.name == "127.0.0.1:9001" and len(config.load().servers) == 2
    # ddpq up's own login, of an earlier data dir: the new first admin's replaces it.
    made = config.remember("http://127.0.0.1:9000", "t9-fresh", "local")
    assert (made.name, made.token, made.login_kept) == ("local", "t9-fresh", False)
    # A login for the URL with another token (a person's own): never overwritten.
    with config.editing() as edit:
        edit.servers["local"] = config.Server("http://127.0.0.1:9000", "t9")  # `ddpq login`
    before = path.read_bytes()
    made = config.remember("http://127.0.0.1:9000", "new", "local")
    assert (made.name, made.token, made.login_kept) == ("local", "t9", True)
    assert path.read_bytes() == before
    made = config.remember("http://127.0.0.1:9000", "t9", "local")
    assert (made.name, made.login_kept) == ("local", False)

    path.unlink()
    path.write_text('[servers.x]\nurl = "http://x"\n')
    with pytest.raises(config.ConfigError, match="needs a url and a token"):
        config.load()


# ---- `ddpq up` logs its user in -------------------------------------------------------------


class Recorder:
    """A local HTTP server that answers 401 to everything and keeps the requests'
    Authorization headers: where a token must never go."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append(self.headers.get("Authorization") or "")
                body = b'{"detail": "who are you?"}'
                self.send_response(401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_up_logs_in_keeps_a_login_made_for_its_url_and_sends_its_token_only_there(
    tmp_path: Path,
) -> None:
    """`ddpq up` saves its admin login as "local"; a member who logs in to that URL as
    themselves stays logged in across a restart of `ddpq up` (the bug: whoami said
    admin), and the banner says who. The data dir's token file goes to its own server
    only, never to another URL."""
    home = Home(tmp_path / "home")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    var = tmp_path / "var"

    def up(log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                up_argv(port, "--cpu-slots", "1"),
                env=_child_env({**home.env(), "DDPQ_DATA_DIR": str(var), **NO_JOBS}),
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        wait_for(lambda: "ddpq is up" in log.read_text(), 60, "the banner")
        return proc

    proc = up(tmp_path / "up.log")
    recorder = Recorder()
    try:
        text = (tmp_path / "up.log").read_text()
        assert (
            'logged in as admin (admin): server "local" in ~/.config/ddpq/config.toml, the'
            " default" in text
        ), text
        token = (var / "api-token").read_text().strip()
        assert home.saved() == {
            "default": "local",
            "servers": {"local": {"url": url, "token": token, "saved_by": "ddpq up"}},
        }
        assert stat.S_IMODE(home.config.stat().st_mode) == 0o600
        who = home.whoami()  # from the home directory: no var/api-token there
        assert (who["name"], who["role"], who["url"], who["server"]) == (
            "admin", "admin", url, "local"
        )  # fmt: skip
        # Beside the token, whose it is: the URL a local client reaches the server at.
        assert (var / "api-url").read_text() == url + "\n"
        assert stat.S_IMODE((var / "api-url").stat().st_mode) == 0o600

        # The token file, from the directory it is in, with no login saved: to its own
        # server, and to no other URL (the recorder sees every header sent).
        stranger = Home(tmp_path / "stranger")
        r = stranger.ddpq("--url", url, "whoami", "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        who = json.loads(r.stdout)
        assert (who["name"], who["token_from"]) == ("admin", str(var / "api-token")), who
        r = stranger.ddpq("--url", recorder.url, "ls", cwd=tmp_path)
        assert r.returncode == 1 and f"{recorder.url} wants a user token" in r.stderr
        assert f"sent only to {url}" in r.stderr, r.stderr
        assert recorder.seen and not any(token in seen for seen in recorder.seen)

        # A member logs in to that URL as themselves.
        added = httpx.post(
            f"{url}/users",
            json={"name": "up-alice"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        assert added.status_code == 201, added.text
        alice = added.json()["token"]
        r = home.ddpq("login", url, "--token-stdin", input=alice)
        assert r.returncode == 0 and 'saved as server "local"' in r.stdout, r.stderr
    finally:
        recorder.close()
        stop_process(proc)
    assert proc.returncode == 0

    # Restarted on the same data dir and port: the member's login is kept, and said.
    proc = up(tmp_path / "again.log")
    try:
        text = (tmp_path / "again.log").read_text()
        assert (
            f"logged in as up-alice (member): your saved login for {url}, server"
            ' "local" in ~/.config/ddpq/config.toml, the default' in text
        ), text
        assert home.saved()["servers"] == {"local": {"url": url, "token": alice}}
        assert home.whoami()["name"] == "up-alice"
    finally:
        stop_process(proc)


def test_up_says_a_saved_login_its_server_refuses_and_keeps_it(
    server: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`ddpq up`'s login step (in-process, against a running API): a saved login for its
    URL that this server refuses (another server's, an earlier data dir's) is kept, and
    the banner's line says so and how to log in again."""
    from ddpq.cli.servers import _log_in_locally

    home = Home(tmp_path / "home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home.path / ".config"))
    monkeypatch.setenv("HOME", str(home.path))
    config.save(config.Config({"mine": config.Server(server.url, "t" * 30)}, "mine", home.config))
    before = home.config.read_bytes()
    port = int(server.url.rsplit(":", 1)[1])
    line = _log_in_locally(
        "127.0.0.1", port, server.api_token, threading.current_thread(), threading.Event(), "F"
    )
    assert line.startswith(f'your saved login for {server.url} (server "mine" in '), line
    assert "is refused by this server (HTTP 401" in line and "kept as it is" in line, line
    assert f"ddpq login {server.url} --server mine (the first admin's token: F)" in line, line
    assert home.config.read_bytes() == before


# ---- people --------------------------------------------------------------------------------


def test_users_add_ls_rotate_revoke_and_whoami_through_the_cli(
    server: Server, home: Home, tmp_path: Path
) -> None:
    home.login(server)
    r = home.ddpq("users", "add", "cli-alice")
    assert r.returncode == 0, r.stderr
    tokens = USER_TOKEN.findall(r.stdout)
    assert len(tokens) == 1, r.stdout
    token = tokens[0]
    assert "shown only now" in r.stdout and f"ddpq login {server.url}" in r.stdout
    r = home.ddpq("users", "add", "cli-alice")
    assert r.returncode == 1 and "HTTP 409" in r.stderr
    r = home.ddpq("users", "add", "cli-root", "--admin", "--json")
    added = json.loads(r.stdout)
    assert added["role"] == "admin" and USER_TOKEN.fullmatch(added["token"])

    alice = Home(tmp_path / "alice")
    alice.login(server, token)
    assert alice.ddpq("whoami").stdout.startswith(f"cli-alice (member) at {server.url} (")

    r = home.ddpq("users", "ls")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.strip().splitlines()
    assert header.split() == ["NAME", "ROLE", "STATE", "TOKEN", "CREATED", "CLOSED"]
    row = next(x.split() for x in rows if x.split()[0] == "cli-alice")
    assert row[1:4] == ["member", "active", token[:10]] and len(row) == 6  # created, open
    assert all(token not in line for line in rows)
    # A member manages no one.
    r = alice.ddpq("users", "ls")
    assert r.returncode == 1 and "HTTP 403" in r.stderr and server.url in r.stderr

    # Owners: --mine and --user are the API's filters; OWNER in the table.
    r = alice.ddpq("submit", "--recipe", "toy-regression", "--name", "alices-job", "--json")
    mine = json.loads(r.stdout)
    r = home.ddpq("submit", "--recipe", "toy-regression", "--name", "admins-job", "--json")
    theirs = json.loads(r.stdout)
    r = alice.ddpq("ls", "--mine", "--json")
    assert {j["owner"] for j in json.loads(r.stdout)["items"]} == {"cli-alice"}
    r = home.ddpq("ls", "--user", "cli-alice", "--json")
    assert [j["id"] for j in json.loads(r.stdout)["items"]] == [mine["id"]]
    r = home.ddpq("ls", "--name", "s-job")
    header, *rows = r.stdout.strip().splitlines()
    assert header.split()[:4] == ["ID", "NAME", "OWNER", "PROGRAM"]
    assert [x.split()[:3] for x in rows] == [
        [str(theirs["id"]), "admins-job", "admin"],
        [str(mine["id"]), "alices-job", "cli-alice"],
    ]
    r = home.ddpq("ls", "--mine", "--user", "x")
    assert r.returncode == 2
    # A member cancels only their own jobs: the reason names the owner.
    r = alice.ddpq("cancel", str(theirs["id"]))
    assert r.returncode == 1 and "HTTP 403" in r.stderr and "admin's" in r.stderr, r.stderr
    assert alice.ddpq("cancel", str(mine["id"])).returncode == 0
    assert home.ddpq("cancel", str(theirs["id"])).returncode == 0

    # Rotate: the old token is refused at once, with where it came from; the new one works.
    r = home.ddpq("users", "rotate", "cli-alice")
    assert r.returncode == 0, r.stderr
    new = USER_TOKEN.findall(r.stdout)
    assert len(new) == 1 and new[0] != token and "shown only now" in r.stdout
    r = alice.ddpq("whoami")
    assert r.returncode == 1 and "refused the token" in r.stderr
    assert 'config.toml, server "default"' in r.stderr and "ddpq login" in r.stderr
    # `ddpq login` with no URL: the default server's, again.
    r = alice.ddpq("login", "--token-stdin", input=new[0])
    assert r.returncode == 0 and f"{server.url} as cli-alice (member)" in r.stdout, r.stderr
    assert alice.saved()["servers"] == {"default": {"url": server.url, "token": new[0]}}
    assert alice.whoami()["name"] == "cli-alice"

    # Your own token rotated: the config file's server is given the new one.
    root = Home(tmp_path / "root")
    root.login(server, added["token"])
    r = root.ddpq("users", "rotate", "cli-root")
    assert r.returncode == 0 and "it was yours" in r.stdout, r.stdout
    assert root.saved()["servers"]["default"]["token"] == USER_TOKEN.findall(r.stdout)[0]
    assert root.whoami()["name"] == "cli-root"

    # Closing an account (`delete` is `deactivate`): refused at once, kept, never reused.
    r = home.ddpq("users", "delete", "cli-alice", "--yes")
    assert r.returncode == 0 and "refused from now on" in r.stdout, r.stderr
    r = alice.ddpq("ls")
    assert r.returncode == 1 and "refused the token" in r.stderr
    r = home.ddpq("users", "deactivate", "cli-alice", "--yes")
    assert r.returncode == 1 and "HTTP 409" in r.stderr and "already closed" in r.stderr
    r = home.ddpq("users", "add", "cli-alice")
    assert r.returncode == 1 and "ddpq users reactivate cli-alice" in r.stderr, r.stderr
    r = home.ddpq("users", "ls")
    row = next(x.split() for x in r.stdout.splitlines() if x.split()[0] == "cli-alice")
    assert row[2] == "deactivated" and row[-2:] == ["by", "admin"], row  # when, by whom
    r = home.ddpq("users", "reactivate", "cli-alice")
    assert r.returncode == 0 and "shown only now" in r.stdout, r.stderr
    alice.login(server, USER_TOKEN.findall(r.stdout)[0])
    assert alice.whoami()["name"] == "cli-alice"

    # The audit trail, newest first.
    r = home.ddpq("audit", "--limit", "6")
    assert r.returncode == 0, r.stderr
    header, *rows, more = r.stdout.strip().splitlines()
    assert header.split() == ["AT", "ACTOR", "ACTION", "TARGET", "DETAIL"]
    assert more.startswith("more: --cursor "), more
    actions = [row.split()[3] for row in rows]
    assert actions[:3] == ["user.reactivate", "user.deactivate", "user.rotate"], rows
    assert "cancel" in actions, rows
    r = home.ddpq("audit", "--limit", "2", "--json")
    page = json.loads(r.stdout)
    assert len(page["items"]) == 2 and page["next_cursor"]
    ids = [e["id"] for e in page["items"]]
    assert ids == sorted(ids, reverse=True)
    r = home.ddpq("audit", "--limit", "2", "--cursor", page["next_cursor"], "--json")
    assert json.loads(r.stdout)["items"][0]["id"] < ids[-1]


def test_help_lists_the_people_commands_in_order_and_fits_80_columns(home: Home) -> None:
    r = home.ddpq("--help", COLUMNS="80")
    commands = re.findall(r"^  ([a-z-]+)  ", r.stdout, re.MULTILINE)
    order = ["up", "login", "logout", "whoami", "submit", "recipes", "users", "audit"]
    assert [c for c in commands if c in order] == order, commands
    assert "--server NAME" in r.stdout
    for cmd in (["login"], ["logout"], ["whoami"], ["users"], ["users", "add"], ["audit"]):
        r = home.ddpq(*cmd, "--help", COLUMNS="80")
        assert r.returncode == 0, (cmd, r.stderr)
        assert max(map(len, r.stdout.splitlines())) <= 80, cmd
        assert "var/api-token" in r.stdout and "DDPQ_TOKEN" in r.stdout, cmd
