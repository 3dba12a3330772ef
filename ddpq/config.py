"""Where the CLI and the Python client find the API and its token: the one owner of
the order, and of the user's config file that `ddpq login` and `ddpq up` write.

The order, for the URL and the token each (``resolve``):

1. flags: ``--url``, ``--token``, ``--server NAME`` (a server of the config file);
2. the environment: ``DDPQ_URL`` (else ``DDPQ_PORT``: http://127.0.0.1:PORT, or
   ``DDPQ_HOST``'s address when that is not a wildcard), ``DDPQ_TOKEN``;
3. the config file (``$XDG_CONFIG_HOME/ddpq/config.toml``, else
   ``~/.config/ddpq/config.toml``): its default server's URL and token, when neither
   was given (a token given alone goes to the URL the environment or the built-in
   default gives); for a URL given by a flag or the environment, the token of the
   server saved with that URL. A stored token is only ever sent to its own URL;
4. the legacy file next to a local ``ddpq serve``/``ddpq up``: ``DDPQ_DATA_DIR/api-token``
   (``./var/api-token``), only to the URL that server wrote beside it when it started
   listening (``api-url``): like a saved login, that token goes to its own server alone.
   A data dir without ``api-url`` (its server started before ddpq wrote one) sends it
   nowhere: restart that server (it writes the file) or ``ddpq login``. Then
   ``DDPQ_API_TOKEN`` (the server's own setting, as in compose's ``.env``), only with a
   URL the environment gives (DDPQ_URL, DDPQ_PORT) or the built-in default, never to one
   a flag or the config file names; the URL http://127.0.0.1:8000.

The config file holds several named servers and a default::

    default = "lab"

    [servers."lab"]
    url = "https://ddpq.lab.example:8000"
    token = "ddpqu_..."

A server ``ddpq up`` saved itself (its first admin's token) also says ``saved_by = "ddpq
up"``: a later ``ddpq up`` may replace that one, never a login a person made.

It is read with tomllib and written here (``save``), whole, atomically, mode 0600 from
its first byte, in a directory made 0700; keys other than these are not kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ddpq.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"
CONFIG_FILE = "config.toml"
# In DDPQ_DATA_DIR, written by a loopback `ddpq serve`/`ddpq up` (service/config.py): the
# first admin's token it generated, and the URL a local client reaches that server at.
LEGACY_TOKEN_FILE = "api-token"  # noqa: S105 - a file name, not a secret
LEGACY_URL_FILE = "api-url"
# A server's name in the config file: a word, or a host:port.
SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
# Addresses a server listens on that a client cannot connect to as such.
WILDCARDS = ("", "0.0.0.0", "::", "[::]")  # noqa: S104 - compared, never bound


def data_dir() -> Path:
    return Path(os.environ.get("DDPQ_DATA_DIR", "./var"))


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME", "")
    # The XDG spec: a relative path is invalid and is ignored.
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "ddpq" / CONFIG_FILE


def shown(path: Path) -> str:
    """A path as a person reads it: under the home directory, with ~."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def normal_url(url: str) -> str:
    return url.strip().rstrip("/")


def local_url(host: str, port: int) -> str:
    """The URL a client on this host reaches a server listening on ``host``:``port`` at
    (a wildcard address by the loopback one)."""
    reach = "127.0.0.1" if host in WILDCARDS else host
    reach = f"[{reach}]" if ":" in reach and not reach.startswith("[") else reach
    return f"http://{reach}:{port}"


def check_url(url: str) -> str:
    """``url`` as stored: http(s) with a host, no trailing slash; ConfigError if not."""
    url = normal_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"{url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{url!r} is not an http(s) URL: give it as http://HOST:PORT")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(f"{url!r}: give the API's URL alone (no user, query or fragment)")
    return url


def name_for(url: str) -> str:
    """The name a server is saved under by default: its URL's host, with the port."""
    parts = urlsplit(url)
    host = (parts.hostname or "server").strip("[]")
    name = f"{host}:{parts.port}" if parts.port else host
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", name).lstrip("._:-")[:64]
    return name or "server"


def check_name(name: str) -> str:
    if not SERVER_NAME.fullmatch(name):
        raise ConfigError(
            f"{name!r} cannot name a server: 1-64 letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return name


# ---- the file ------------------------------------------------------------------------


@dataclass
class Server:
    url: str
    token: str
    # Who saved it, when it was not a person: "ddpq up" (the first admin's token of its
    # data dir, which a later `ddpq up` may replace). A login a person made has none.
    saved_by: str | None = None


@dataclass
class Config:
    servers: dict[str, Server] = field(default_factory=dict)
    default: str | None = None
    path: Path = field(default_factory=config_path)

    def where(self, name: str) -> str:
        """A server of this file, as an error message names it."""
        return f'{shown(self.path)}, server "{name}"'

    def named(self, name: str) -> Server:
        found = self.servers.get(name)
        if found is None:
            known = ", ".join(f'"{n}"' for n in self.servers) or "none: `ddpq login` saves one"
            raise ConfigError(f'no server "{name}" in {shown(self.path)} (its servers: {known})')
        return found

    def of_url(self, url: str) -> str | None:
        """The server saved with ``url``: the default if it is one, else the first."""
        url = normal_url(url)
        names = [n for n, s in self.servers.items() if normal_url(s.url) == url]
        return self.default if self.default in names else (names[0] if names else None)


def load(path: Path | None = None) -> Config:
    """The config file; an empty Config when there is none."""
    path = path or config_path()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return Config(path=path)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {shown(path)}: {exc}") from None
    servers: dict[str, Server] = {}
    raw = data.get("servers", {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{shown(path)}: 'servers' must be a table of [servers.NAME]")
    for name, entry in raw.items():
        url = entry.get("url") if isinstance(entry, dict) else None
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(url, str) or not isinstance(token, str):
            raise ConfigError(f'{shown(path)}: server "{name}" needs a url and a token (text)')
        saved_by = entry.get("saved_by")
        servers[name] = Server(
            normal_url(url), token.strip(), saved_by if isinstance(saved_by, str) else None
        )
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"{shown(path)}: 'default' must be a server's name (text)")
    return Config(servers, default, path)


def _quoted(value: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = ['"']
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def render(cfg: Config) -> str:
    lines = [
        "# ddpq's servers and their tokens: written by `ddpq login`, `ddpq logout` and",
        "# `ddpq up`. It holds secrets: keep it yours alone (mode 0600).",
    ]
    if cfg.default is not None:
        lines += [f"default = {_quoted(cfg.default)}"]
    for name, server in cfg.servers.items():
        lines += [
            "",
            f"[servers.{_quoted(name)}]",
            f"url = {_quoted(server.url)}",
            f"token = {_quoted(server.token)}",
        ]
        if server.saved_by:
            lines += [f"saved_by = {_quoted(server.saved_by)}"]
    return "\n".join(lines) + "\n"


def save(cfg: Config) -> None:
    """Write ``cfg`` whole: a temporary file (0600 from its first byte) renamed over the
    file, so a reader sees the old file or the new one, never part of one. A link is
    followed: the file it points at is replaced."""
    path = Path(os.path.realpath(cfg.path))
    _make_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(render(cfg))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _make_dir(directory: Path) -> None:
    if directory.is_dir():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # whatever the umask


@contextlib.contextmanager
def editing(path: Path | None = None) -> Iterator[Config]:
    """The config file to change, saved when the block ends without an error; one
    writer at a time (a lock on its directory), so two logins lose neither."""
    path = path or config_path()
    directory = Path(os.path.realpath(path)).parent
    _make_dir(directory)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cfg = load(path)
        yield cfg
        save(cfg)
    finally:
        os.close(fd)  # and the lock with it


@dataclass(frozen=True)
class Remembered:
    name: str  # the server saved for the URL: the one given, or the login kept
    default: str | None  # the config's default server after it
    kept: str | None  # the URL of a server named ``preferred`` that was left alone
    path: Path
    token: str  # the token saved for the URL: the one given, or the login's
    login_kept: bool  # a login for the URL with another token was left as it was


def remember(url: str, token: str, preferred: str) -> Remembered:
    """Save ``url`` and ``token`` as the server ``preferred`` (`ddpq up`: "local"),
    the default if there is none, unless a login for ``url`` is saved already: the
    server the CLI uses for that URL (``Config.of_url``) is never overwritten. With this
    token nothing changes; with another (a person's `ddpq login` as themselves, or a
    login kept from an earlier data dir) it stays, and is returned (``login_kept``) for
    the caller to say whose it is. Only a login ``ddpq up`` saved itself (``saved_by``:
    the first admin's token of an earlier data dir) is replaced by the new one. A server
    named ``preferred`` saved with another URL is left alone too: this one is saved under
    its HOST:PORT instead."""
    url = check_url(url)
    # Read first: a login found is left as it is, the file not even written again.
    found = _saved_for(load(), url, token)
    if found is not None:
        return found
    with editing() as cfg:
        found = _saved_for(cfg, url, token)  # saved meanwhile
        if found is not None:
            return found
        name = cfg.of_url(url) or preferred  # a login of ddpq up's own, replaced
        kept = None
        old = cfg.servers.get(name)
        if old is not None and old.url != url:  # of another URL: none is saved with this one
            kept = old.url
            name = base = name_for(url)
            n = 1
            while name in cfg.servers:
                n += 1
                name = f"{base}-{n}"
        cfg.servers[name] = Server(url, token, UP)
        if cfg.default is None or cfg.default not in cfg.servers:
            cfg.default = name
        return Remembered(name, cfg.default, kept, cfg.path, token, False)


UP = "ddpq up"


def _saved_for(cfg: Config, url: str, token: str) -> Remembered | None:
    """The login the CLI uses for ``url``, if one is saved and is to stay: a person's,
    or ``ddpq up``'s own with this very token."""
    name = cfg.of_url(url)
    if name is None:
        return None
    saved = cfg.servers[name]
    if saved.saved_by == UP and saved.token != token:
        return None  # the first admin's of an earlier data dir: ddpq up's to replace
    return Remembered(name, cfg.default, None, cfg.path, saved.token, saved.token != token)


# ---- the order -----------------------------------------------------------------------

FLAGS = ("--url", "--token", "--server")


@dataclass(frozen=True)
class Target:
    """Where requests go, with what token, and where each came from (in words)."""

    url: str
    token: str | None
    url_from: str
    token_from: str  # "no token" when there is none
    server: str | None = None  # the config file's server whose token (or URL) is used
    # Without a token: one that was found but is not this URL's to have, and why.
    withheld: str | None = None

    def origin(self) -> str:
        """Where the URL and the token came from, for an error message."""
        if self.url_from == self.token_from:
            return f"URL and token from {self.url_from}"
        token = "no token" if self.token is None else f"token from {self.token_from}"
        return f"URL from {self.url_from}; {token}"


def _env(var: str) -> str:
    return os.environ.get(var, "").strip()


def env_url() -> tuple[str, str] | None:
    """The URL the environment gives, and which variable gave it; ConfigError for a
    DDPQ_PORT that is not a port."""
    url = _env("DDPQ_URL")
    if url:
        return normal_url(url), "DDPQ_URL"
    port = _env("DDPQ_PORT")
    if not port:
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"DDPQ_PORT must be a port number (1-65535), not {port!r}")
    host = _env("DDPQ_HOST")
    if host in WILDCARDS:
        return f"http://127.0.0.1:{int(port)}", "DDPQ_PORT"
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{int(port)}", "DDPQ_HOST and DDPQ_PORT"


def resolve(
    url: str | None = None,
    token: str | None = None,
    server: str | None = None,
    flags: tuple[str, str, str] = FLAGS,
) -> Target:
    """The URL and token to use, in the order of this module's docstring. ``url``,
    ``token`` and ``server`` are the flags (``flags`` names them in messages). The
    config file is read only when the flags and the environment leave something open.
    ConfigError: a server that is not in the file, a file that cannot be read."""
    flag_url, flag_token, flag_server = flags
    url = normal_url(url) if url else None
    token = token.strip() if token else None
    if url and server:
        raise ConfigError(f"give {flag_url} or {flag_server}, not both")
    cache: list[Config] = []

    def cfg() -> Config:
        if not cache:
            cache.append(load())
        return cache[0]

    chosen: str | None = None  # the server of the config file the URL came from
    from_env = None if url or server else env_url()
    if url:
        where = flag_url
    elif server:
        url, chosen = cfg().named(server).url, server
        where = cfg().where(server)
    elif from_env:
        url, where = from_env
    elif not token and not _env("DDPQ_TOKEN") and cfg().default:
        # The default server only with its own token: a token given by a flag or the
        # environment goes to the URL they give, or to the legacy default.
        chosen = cfg().default
        url, where = cfg().named(chosen or "").url, cfg().where(chosen or "")
    else:
        url, where = DEFAULT_URL, "the built-in default"
    # The environment's own URL (or the default): DDPQ_API_TOKEN may go there.
    env_url_used = bool(from_env) or where == "the built-in default"

    if token:
        return Target(url, token, where, flag_token, chosen)
    if server:  # a flag: before the environment
        return Target(url, cfg().named(server).token or None, where, where, server)
    if _env("DDPQ_TOKEN"):
        return Target(url, _env("DDPQ_TOKEN"), where, "DDPQ_TOKEN", chosen)
    name = chosen or cfg().of_url(url)
    if name is not None and cfg().servers[name].token:
        return Target(url, cfg().servers[name].token, where, cfg().where(name), name)
    legacy, withheld = _legacy_token(url)
    if legacy is not None:
        return Target(url, legacy, where, shown((data_dir() / LEGACY_TOKEN_FILE).absolute()))
    if _env("DDPQ_API_TOKEN"):
        if env_url_used:
            return Target(url, _env("DDPQ_API_TOKEN"), where, "DDPQ_API_TOKEN", None)
        withheld = withheld or (
            f"DDPQ_API_TOKEN goes only to the URL the environment gives (DDPQ_URL), not to"
            f" one from {where}"
        )
    return Target(url, None, where, "no token", None, withheld)


def _legacy_token(url: str) -> tuple[str | None, str | None]:
    """The token of a local server's data dir (``api-token``) if ``url`` is the server
    that wrote it (its ``api-url``); else None, and why it is withheld (None: no file)."""
    path = data_dir() / LEGACY_TOKEN_FILE
    token = _text_of(path)
    if not token:
        return None, None
    written_for = _text_of(data_dir() / LEGACY_URL_FILE)
    here = shown(path.absolute())
    if not written_for:
        # Its server started before ddpq recorded whose it is: it is sent nowhere.
        return None, (
            f"{here} has no {LEGACY_URL_FILE} beside it to say which server wrote it: "
            "restart that ddpq serve or ddpq up (it writes one), or ddpq login"
        )
    if normal_url(written_for) != normal_url(url):
        return None, f"{here} is sent only to {written_for}, the server that wrote it"
    return token, None


def _text_of(path: Path) -> str:
    """A small file's text, stripped; "" when there is none."""
    try:
        return path.read_text().strip() if path.is_file() else ""
    except (OSError, UnicodeDecodeError):
        return ""


def api_url() -> str:
    return resolve().url


def user_token() -> str | None:
    return resolve().token


def _token_from(var: str, filename: str) -> str | None:
    token = _env(var)
    if token:
        return token
    path = data_dir() / filename
    if path.is_file():
        return path.read_text().strip() or None
    return None


def worker_token() -> str | None:
    return _token_from("DDPQ_WORKER_TOKEN", "worker-token")
