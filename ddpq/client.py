"""A small Python client of the ddpq API.

    from ddpq.client import Client
    with Client() as c:   # URL and token found as the CLI finds them (ddpq.config): the
                          # arguments url=, token=, server=, then DDPQ_URL/DDPQ_TOKEN,
                          # then the servers `ddpq login` saved, then ./var/api-token
        job = c.submit({"recipe": "toy-regression", "world_size": 2})
        job = c.wait(job["id"])

Errors are ddpq.errors': ``ApiError`` for a request that did not do what was asked,
naming it (``.method``, ``.url``) and what was answered (``.status``, ``.detail``):
``ApiRefused`` (4xx), ``ApiUnavailable`` (5xx, 429; ``ApiUnreachable``: no answer at
all), ``ApiBadAnswer`` (not the API's JSON); ``ConfigError`` for a server name the
config file does not hold; ``CodeError`` for a directory push_code cannot send. Catch
``ddpq.errors.DdpqError`` for all of them. ``Client.target`` says where the URL and the
token came from (ddpq.config.resolve).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from ddpq import codepack, config, pack
from ddpq.errors import ApiError as ApiError  # where it was before ddpq.errors
from ddpq.errors import ApiRefused, bad_answer
from ddpq.errors import format_detail as format_detail
from ddpq.http import Http
from ddpq.snapshot import Limits
from ddpq.wire import CUT_MARKER

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})

_MARKER_WINDOW = 512  # longer than any marker line: a marker split across chunks is found


class _Offsets:
    """Where a log answer has got to, in the stored log's offsets (markers excluded)."""

    def __init__(self, start: int) -> None:
        self.base = start  # the offset of the first byte after the last marker seen
        self.since = 0  # bytes received after that marker
        # The answer's last bytes, to find a marker split across chunks. A marker is a
        # line of its own (a rank's lines all start "[rankN]:"), so it must follow a
        # newline; the answer's start counts as one.
        self.recent = b"\n"

    def feed(self, chunk: bytes) -> int:
        window = self.recent + chunk
        last = None
        for m in CUT_MARKER.finditer(window):
            if m.end() > len(self.recent):  # a marker not seen in an earlier chunk
                last = m
        if last is None:
            self.since += len(chunk)
        else:
            self.base, self.since = int(last.group(1)), len(window) - last.end()
        self.recent = window[-_MARKER_WINDOW:]
        return self.base + self.since


def _segment(value: str) -> str:
    """``value`` as one path segment: a name with a slash or a dot-dot stays a name."""
    return quote(value, safe="")


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        server: str | None = None,
        target: config.Target | None = None,
    ) -> None:
        """``url``, ``token``, ``server`` (a server ``ddpq login`` saved) stand for the
        CLI's flags; what they leave open comes from the environment, the config file,
        ./var/api-token (ddpq.config.resolve). ``target``: resolved already."""
        self.target = target or config.resolve(
            url, token, server, flags=("url=", "token=", "server=")
        )
        self.url = self.target.url
        self._http = Http(self.url, self.target.token, timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """The answer to ``method path``; ApiError (ddpq.errors) unless it is a success."""
        return self._http.request(method, path, **kw)

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        """The JSON the API answered ``method path`` with (ApiBadAnswer if it is not)."""
        r = self._call(method, path, **kw)
        try:
            return r.json()
        except ValueError:
            raise bad_answer(method, str(r.request.url), r.status_code, r.text) from None

    def submit(
        self, spec: dict[str, Any], idempotency_key: str | None = None, strict: bool = False
    ) -> dict[str, Any]:
        """Queue a job; ``strict``: refused (409) if no registered worker could ever run it."""
        # An empty key is sent too, for the API to refuse: dropping it would submit
        # without the protection the caller asked for.
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else {}
        params = {"strict": "true"} if strict else {}
        result: dict[str, Any] = self._json(
            "POST", "/jobs", json=spec, headers=headers, params=params
        )
        return result

    # ---- code snapshots -------------------------------------------------------------

    def push_code(
        self, root: Path, progress: Callable[[int, int], None] | None = None
    ) -> codepack.Pushed:
        """Send the directory ``root`` as a code snapshot (ddpq.codepack says what of it
        goes), uploading only the contents the API lacks. ``progress(sent, total)`` is
        called as contents go. CodeError: over a limit, or a name that cannot be sent."""
        found = codepack.collect(root)
        lim = self._json("GET", "/code/limits")
        codepack.check_limits(found, Limits(**lim))
        entries, kept = codepack.read_hashed(found)
        digests = sorted({e.digest for e in entries if e.digest})
        missing = set(self._json("POST", "/code/missing", json={"digests": digests})["missing"])
        total = sum(e.size for e in {e.digest: e for e in entries if e.digest in missing}.values())
        sent_so_far = 0
        lock = threading.Lock()

        def advanced(n: int) -> None:
            nonlocal sent_so_far
            with lock:
                sent_so_far += n
                if progress is not None:
                    progress(sent_so_far, total)

        upload = httpx.Timeout(30.0, write=600.0)

        def put(digest: str, data: bytes) -> None:
            self._call(
                "PUT",
                f"/code/blobs/{digest}",
                content=data,
                headers={"Content-Type": "application/octet-stream"},
                timeout=upload,
            )

        def post(body: bytes) -> None:
            self._call(
                "POST",
                "/code/packs",
                content=body,
                headers={"Content-Type": pack.MEDIA_TYPE},
                timeout=upload,
            )

        packs = self._pack_limits() if missing else None
        if packs is not None:
            new, sent = codepack.upload_packs(
                entries, found.sources, missing, kept, post, *packs, advanced
            )
        else:
            new, sent = codepack.upload(entries, found.sources, missing, put, advanced)
        made = self._json("POST", "/code/snapshots", json={"files": [e.wire() for e in entries]})
        return codepack.Pushed(
            made["id"],
            made["files"],
            made["bytes"],
            new,
            sent,
            found.skipped,
            found.left_out,
            codepack.named_in_sources(found),
            codepack.checkpoint_like(entries),
        )

    def _pack_limits(self) -> tuple[int, int] | None:
        """(largest body, most bytes uncompressed) of POST /code/packs; None from an API
        older than packs (404), which takes one PUT a content."""
        try:
            lim = self._json("GET", "/code/packs")
        except ApiRefused as exc:
            if exc.status in (404, 405):
                return None
            raise
        return int(lim["max_body_bytes"]), int(lim["max_content_bytes"])

    def code(self, snapshot_id: str) -> dict[str, Any]:
        """A snapshot's manifest: id, files, bytes, manifest (path, size, digest, ...)."""
        result: dict[str, Any] = self._json("GET", f"/code/snapshots/{snapshot_id}")
        return result

    def code_blob(self, digest: str) -> bytes:
        return self._call("GET", f"/code/blobs/{digest}").content

    def outputs(self, job_id: int) -> dict[str, Any]:
        """What a job wrote in its directory beyond its code (items: path, change, size,
        digest or symlink), the snapshot of that directory, and until when it is kept."""
        result: dict[str, Any] = self._json("GET", f"/jobs/{job_id}/outputs")
        return result

    def job(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/jobs/{job_id}")
        return result

    def attempts(self, job_id: int) -> list[dict[str, Any]]:
        """A job's attempts, oldest first: number, worker, outcome, reason, ..."""
        result: dict[str, Any] = self._json("GET", f"/jobs/{job_id}/attempts")
        return list(result["items"])

    def jobs(
        self,
        status: str | list[str] | None = None,
        limit: int = 50,
        cursor: str | None = None,
        name: str | None = None,
        user: str | None = None,
        mine: bool = False,
    ) -> dict[str, Any]:
        """A page of jobs, newest first; ``user``: only that user's, ``mine``: only the
        token's user's (the API filters)."""
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status if isinstance(status, str) else ",".join(status)
        if cursor:
            params["cursor"] = cursor
        if name:
            params["name"] = name
        if user:
            params["user"] = user
        if mine:
            params["mine"] = "true"
        result: dict[str, Any] = self._json("GET", "/jobs", params=params)
        return result

    def cancel(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", f"/jobs/{job_id}/cancel")
        return result

    def hold(self, job_id: int) -> dict[str, Any]:
        """Hold a queued job back until it is released."""
        result: dict[str, Any] = self._json("POST", f"/jobs/{job_id}/hold")
        return result

    def release(self, job_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", f"/jobs/{job_id}/release")
        return result

    def change(self, job_id: int, **fields: Any) -> dict[str, Any]:
        """Change a queued or held job: priority, timeout_s (0: none), world_size."""
        body = {k: v for k, v in fields.items() if v is not None}
        result: dict[str, Any] = self._json("PATCH", f"/jobs/{job_id}", json=body)
        return result

    # ---- sweeps (docs/experiments.md) ----------------------------------------------------

    def submit_sweep(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Start a sweep (POST /sweeps): ``spec["job"]`` is a job spec (its ``code`` a
        snapshot push_code sent), ``space``, ``method``, ``metric``, ...; its first trials
        are queued at once. Returns the sweep with its trials."""
        result: dict[str, Any] = self._json("POST", "/sweeps", json=spec)
        return result

    def sweeps(
        self,
        status: str | list[str] | None = None,
        user: str | None = None,
        mine: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """A page of sweeps, newest first (``items``, ``next_cursor``), without trials."""
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status if isinstance(status, str) else ",".join(status)
        if user:
            params["user"] = user
        if mine:
            params["mine"] = "true"
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = self._json("GET", "/sweeps", params=params)
        return result

    def sweep(self, sweep_id: int) -> dict[str, Any]:
        """One sweep with its trials ranked by its metric (``trials``) and its ``best``."""
        result: dict[str, Any] = self._json("GET", f"/sweeps/{sweep_id}")
        return result

    def cancel_sweep(self, sweep_id: int) -> dict[str, Any]:
        """Cancel a sweep and its trials."""
        result: dict[str, Any] = self._json("POST", f"/sweeps/{sweep_id}/cancel")
        return result

    def export_sweep(self, sweep_id: int, format: str = "csv") -> bytes:
        """The sweep's table, one row per trial, as CSV or JSON (``format``)."""
        params = {"format": format}
        return self._call("GET", f"/sweeps/{sweep_id}/export", params=params).content

    # ---- people ---------------------------------------------------------------------------

    def whoami(self) -> dict[str, Any]:
        """The token's user: ``{"name", "role"}`` (role ``admin`` or ``member``)."""
        result: dict[str, Any] = self._json("GET", "/whoami")
        return result

    def users(self) -> list[dict[str, Any]]:
        """Every user, closed accounts too (admins): name, role, state, created_at,
        revoked_at (when it was closed), deactivated_by, token_hint."""
        items: list[dict[str, Any]] = self._json("GET", "/users")["items"]
        return items

    def add_user(self, name: str, admin: bool = False) -> dict[str, Any]:
        """A new user (admins); the answer's ``token`` is shown this once."""
        body = {"name": name, "role": "admin" if admin else "member"}
        result: dict[str, Any] = self._json("POST", "/users", json=body)
        return result

    def revoke_user(self, name: str) -> dict[str, Any]:
        """Close a user's account as ``deactivate_user`` does by default (its older name);
        the user."""
        result: dict[str, Any] = self._json("POST", f"/users/{_segment(name)}/revoke")
        return result

    def deactivate_user(
        self, name: str, jobs: str = "cancel-queued", to: str | None = None
    ) -> dict[str, Any]:
        """Close a user's account (admins): its token is refused at once and its jobs
        handled as ``jobs`` says (cancel-queued, cancel-all, keep, transfer ``to``
        another user). The answer lists the jobs cancelled, transferred and kept."""
        params = {"jobs": jobs, **({"to": to} if to else {})}
        result: dict[str, Any] = self._json("DELETE", f"/users/{_segment(name)}", params=params)
        return result

    def reactivate_user(self, name: str) -> dict[str, Any]:
        """Open a closed account again (admins), with a new token in ``token``."""
        result: dict[str, Any] = self._json("POST", f"/users/{_segment(name)}/reactivate")
        return result

    def rotate_user(self, name: str) -> dict[str, Any]:
        """A new token for a user (admins), in ``token``; the old one stops working."""
        result: dict[str, Any] = self._json("POST", f"/users/{_segment(name)}/rotate")
        return result

    def quotas(self) -> list[dict[str, Any]]:
        """Every user's limits, and everyone's default (user ``*``)."""
        items: list[dict[str, Any]] = self._json("GET", "/quotas")["items"]
        return items

    def set_quota(self, name: str, **limits: int | None) -> dict[str, Any]:
        """Set ``name``'s limits (admins; ``*``: everyone's default): max_gpus,
        max_running, max_queued (None: no limit), max_priority (None: the default's)."""
        result: dict[str, Any] = self._json("PUT", f"/quotas/{name}", json=limits)
        return result

    def clear_quota(self, name: str) -> None:
        self._call("DELETE", f"/quotas/{name}")

    # ---- secrets: values in, names out ------------------------------------------------------

    def set_secret(self, name: str, value: str) -> dict[str, Any]:
        """Set one of the token's user's secrets (created or replaced); its value reaches
        only the ranks of their jobs whose spec names it (``secrets: [NAME]``). The answer
        holds its name and times, never the value."""
        result: dict[str, Any] = self._json(
            "PUT", f"/secrets/{_segment(name)}", json={"value": value}
        )
        return result

    def secrets(self, user: str | None = None) -> list[dict[str, Any]]:
        """The names of the token's user's secrets (an admin: ``user``'s) and when each
        was set: ``[{"name", "owner", "created_at", "updated_at"}]``; never a value."""
        params = {"user": user} if user else {}
        items: list[dict[str, Any]] = self._json("GET", "/secrets", params=params)["items"]
        return items

    def delete_secret(self, name: str) -> None:
        self._call("DELETE", f"/secrets/{_segment(name)}")

    # ---- users' caches on the workers --------------------------------------------------------

    def caches(self, user: str | None = None, worker: str | None = None) -> list[dict[str, Any]]:
        """Each cache as its worker last reported it: ``[{"worker", "user", "bytes",
        "files", "last_used", "reported_at", "clearing"}]``; the token's user's (an
        admin: ``user``'s, everyone's when None), on ``worker`` if given."""
        params = {k: v for k, v in (("user", user), ("worker", worker)) if v}
        items: list[dict[str, Any]] = self._json("GET", "/caches", params=params)["items"]
        return items

    def clear_caches(
        self, user: str | None = None, worker: str | None = None
    ) -> list[dict[str, Any]]:
        """Ask the workers to clear ``user``'s caches (the token's user's when None), or
        ``worker``'s alone; the caches asked for."""
        body = {k: v for k, v in (("user", user), ("worker", worker)) if v}
        items: list[dict[str, Any]] = self._json("POST", "/caches/clear", json=body)["items"]
        return items

    def usage(self) -> list[dict[str, Any]]:
        """Each user's running and queued jobs, GPU- and CPU-slot-hours over the last day
        and week, and the decayed usage fair share orders by; most used first."""
        items: list[dict[str, Any]] = self._json("GET", "/usage")["items"]
        return items

    def queue(self, user: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        """GET /queue: the queued jobs in the order the claims try them, with estimates."""
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if user is not None:
            params["user"] = user
        page: dict[str, Any] = self._json("GET", "/queue", params=params)
        return page

    def accounting(self, **query: Any) -> dict[str, Any]:
        """One page of GET /accounting (since, until, per, user, status, worker, sweep,
        limit, cursor; None values left out): its rows, next_cursor and the totals."""
        params = {k: v for k, v in query.items() if v is not None}
        page: dict[str, Any] = self._json("GET", "/accounting", params=params)
        return page

    def audit(self, limit: int = 100, cursor: str | None = None) -> dict[str, Any]:
        """A page of the audit trail (admins), newest first: ``{"items": [{"id", "at",
        "actor", "action", "target", "detail"}], "next_cursor"}``."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        result: dict[str, Any] = self._json("GET", "/audit", params=params)
        return result

    def metrics(
        self,
        job_id: int,
        name: str | list[str] | None = None,
        since_step: int | None = None,
        max_points: int | None = None,
    ) -> list[dict[str, Any]]:
        """Metric points, oldest step first; ``since_step`` includes that step;
        ``max_points``: at most that many per name, downsampled as the API does."""
        params: dict[str, Any] = {}
        if name:
            params["name"] = name
        if since_step is not None:
            params["since_step"] = since_step
        if max_points is not None:
            params["max_points"] = max_points
        items: list[dict[str, Any]] = self._json("GET", f"/jobs/{job_id}/metrics", params=params)[
            "items"
        ]
        return items

    def job_gpus(self, job_id: int, max_points: int = 0) -> list[dict[str, Any]]:
        """The job's system metrics: each GPU it held, its latest use and at most
        ``max_points`` of its history (none without NVML on its workers)."""
        items: list[dict[str, Any]] = self._json(
            "GET", f"/jobs/{job_id}/gpus", params={"max_points": max_points}
        )["items"]
        return items

    def checkpoints(self, job_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._json("GET", f"/jobs/{job_id}/checkpoints")["items"]
        return items

    def send_checkpoint(self, job_id: int, checkpoint_id: int) -> dict[str, Any]:
        """Ask for a kept checkpoint to be sent to the API (its worker does so at its next
        heartbeat); the checkpoint, with ``snapshot`` once sent."""
        path = f"/jobs/{job_id}/checkpoints/{checkpoint_id}/send"
        result: dict[str, Any] = self._json("POST", path)
        return result

    def workers(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._json("GET", "/workers")["items"]
        return items

    def recipes(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._json("GET", "/recipes")["items"]
        return items

    def logs(self, job_id: int, offset: int = 0) -> tuple[bytes, int, str]:
        """(bytes from offset, next offset, job status)."""
        r = self._call("GET", f"/jobs/{job_id}/logs", params={"offset": offset})
        return r.content, int(r.headers["X-Next-Offset"]), r.headers.get("X-Job-Status", "")

    def follow_logs(
        self, job_id: int, offset: int = 0, poll_s: float = 0.5
    ) -> Iterator[tuple[int, bytes]]:
        """Yield (offset, bytes) as the log grows, until the job has ended and all is read.

        Asks with ``follow=true``: a server that streams keeps the answer open while
        the job runs; one that does not answers what it has stored. Either way, when
        an answer ends the job's status decides: not over yet, ask again from the
        offset reached (after ``poll_s`` when nothing came); over, and an answer
        given after the end brought nothing more, done: the log is drained.
        """
        # No read timeout on a streamed answer would hang on a dead peer forever;
        # a long one, then asking again from the offset reached, costs nothing.
        timeout = httpx.Timeout(30.0, read=120.0)
        path = f"/jobs/{job_id}/logs"
        while True:
            got = 0
            status = ""
            try:
                with self._http.stream(
                    "GET", path, params={"offset": offset, "follow": "true"}, timeout=timeout
                ) as r:
                    status = r.headers.get("X-Job-Status", "")
                    at = _Offsets(offset)
                    for chunk in r.iter_bytes():
                        if chunk:
                            yield offset, chunk
                            offset = at.feed(chunk)
                            got += len(chunk)
            except httpx.ReadTimeout:
                pass  # a quiet stream: ask again from where we are
            if got:
                continue  # the stored part may have been cut at the size limit
            if status in TERMINAL:
                return  # an answer given after the job ended brought nothing more
            if status == "" and self.job(job_id)["status"] in TERMINAL:
                continue  # no status header: one more answer, given after the end
            time.sleep(poll_s)

    def wait(
        self, job_id: int, timeout: float | None = None, poll_s: float = 0.5
    ) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']}")
            time.sleep(poll_s)
