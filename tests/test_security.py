"""Nobody gets in, and no input breaks it (issue 7): tokens on every route, input
limits, what a job spec may ask of a worker, checkpoints that never run code, and
the refusal to serve an open job launcher. Against a real `ddpq serve` on SQLite
and Postgres where the database matters.

A test that looks only at what it made (its job, its upload, what its requests added to
the list of jobs) runs on the module's server of its database (``api``: what a test leaves
active is ended after it, helpers.its_turn); one that reads the database itself has a
server of its own (``server``)."""

from __future__ import annotations

import ast
import hashlib
import http.client
import json
import os
import pickle
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from ddpq.jobspec import ClaimedSpec
from service.config import Settings, TokenError, resolve_tokens
from service.schemas import JobSpec
from tests.conftest import (
    REPO,
    Server,
    serve_on_a_reachable_address,
    start_server,
    stop_server,
    terminal,
)
from tests.helpers import finish, job_runner, submit_and_claim

GOOD = {"recipe": "toy-regression", "world_size": 2}
# Open by design (DESIGN.md): liveness, the dashboard's static shell, the API's description.
OPEN = {"/healthz", "/", "/openapi.json"}


def _is_open(path: str) -> bool:
    return path in OPEN or path.startswith("/static/")


def _state(server: Server, job_ids: list[int]) -> Any:
    """Everything a refused request could have changed, as the user sees it."""
    user = server.client()
    return {
        "jobs": user.get("/jobs", params={"limit": 500}).json(),
        "workers": user.get("/workers").json(),
        **{
            f"{jid}/{what}": user.get(f"/jobs/{jid}/{what}").json()
            for jid in job_ids
            for what in ("metrics", "checkpoints")
        },
        **{f"{jid}/logs": user.get(f"/jobs/{jid}/logs").text for jid in job_ids},
    }


@pytest.fixture
def still_server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    """A server whose leases outlast the walk: the attempts it compares before and after
    send no heartbeats, and a walk slowed past the 30 s lease (a loaded CI machine) saw
    them lost and requeued, a change no refused request made."""
    s = start_server(db_url, tmp_path / "api", DDPQ_LEASE_S="3600")
    yield s
    stop_server(s)


@pytest.mark.long  # every route and wrong token: about 40 s a database (make test-long)
def test_every_route_refuses_every_wrong_token_and_changes_nothing(still_server: Server) -> None:
    server = still_server
    a = submit_and_claim(server)  # job A, its attempt live
    b = submit_and_claim(server)  # job B, its attempt live
    c = submit_and_claim(server)
    finish(server, c)  # job C's attempt has ended
    queued = server.client().post("/jobs", json=GOOD).json()
    ids = [a["job_id"], b["job_id"], c["job_id"], queued["id"]]
    doc = httpx.get(f"{server.url}/openapi.json").json()
    kinds = {
        "userToken": "user", "adminToken": "admin", "workerToken": "worker", "jobToken": "job"
    }  # fmt: skip
    member = server.client().post("/users", json={"name": "mallory"}).json()["token"]
    before = _state(server, ids)

    wrong: dict[str, list[tuple[str | None, str, int]]] = {
        # (token, why, expected status), for a route of each kind
        "user": [("worker", "worker token", 403), (a["token"], "job token", 403)],
        "admin": [
            ("worker", "worker token", 403),
            (a["token"], "job token", 403),
            (member, "a member's token", 403),
        ],
        "worker": [
            ("user", "user token", 403),
            (member, "a member's token", 403),
            (a["token"], "job token", 403),
        ],
        "job": [
            ("user", "user token", 403),
            (member, "a member's token", 403),
            ("worker", "worker token", 403),
            (b["token"], "job B's token on job A", 403),
            (c["token"], "an ended attempt's token", 403),
        ],
    }
    common = [(None, "no token", 401), ("not-a-token-at-all-1234", "a wrong token", 401)]
    walked = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if _is_open(path):
                assert "security" not in op, path
                continue
            (scheme,) = [name for req in op["security"] for name in req]
            kind = kinds[scheme]
            url = path.replace("{job_id}", str(a["job_id"]))
            for token, why, status in common + wrong[kind]:
                # A bad body too: the token is checked before the body is even read.
                for body in (b'{"recipe": "toy-regression"}', b"{not json"):
                    r = server.client(token).request(
                        method.upper(),
                        url,
                        content=body if method == "post" else None,
                        headers={"Content-Type": "application/json"},
                    )
                    assert r.status_code == status, (method, path, why, r.status_code, r.text)
                    assert "detail" in r.json()
            if kind == "job":  # an ended attempt's token on its own job's route
                r = server.client(c["token"]).request(
                    method.upper(), path.replace("{job_id}", str(c["job_id"])), json={}
                )
                assert r.status_code == 403 and "ended" in r.text, r.text
            walked += 1
    assert walked >= 15  # every route the document lists, present and future
    assert _state(server, ids) == before
    # The gate also holds for ids that are not ids, and for undocumented methods.
    for url in ("/jobs/abc", "/jobs/0/metrics", f"/jobs/{2**64}/cancel"):
        assert server.client(None).post(url, json={}).status_code == 401
    assert server.client(None).delete(f"/jobs/{a['job_id']}").status_code == 401
    assert server.client(None).get("/healthz").json()["status"] == "ok"


def test_tokens_never_appear_in_answers_or_logs(api: Server) -> None:
    server = api  # the module's: its log holds every test's requests, all checked
    claim = submit_and_claim(server)
    token = claim["token"]
    rank0 = server.client(token)
    jid = claim["job_id"]
    rank0.post(f"/jobs/{jid}/metrics", json={"items": [{"step": 1, "values": {"loss": 1}}]})
    rank0.post(
        f"/jobs/{jid}/checkpoints", json={"path": f"{claim['checkpoint_dir']}/a.pt", "step": 1}
    )
    server.client(None).get("/jobs")
    server.client("not-the-token-000000").get("/jobs")
    user = server.client()
    answers = [
        user.get(p).text
        for p in ("/jobs", f"/jobs/{jid}", f"/jobs/{jid}/metrics", f"/jobs/{jid}/checkpoints")
    ]
    answers += [user.get(f"/jobs/{jid}/logs").text, user.get("/workers").text]
    answers.append(finish(server, claim).__repr__())
    secrets_ = (token, server.api_token, server.worker_token)
    for text in [*answers, server.log()]:
        for secret in secrets_:
            assert secret not in text
    assert "/jobs" in httpx.get(f"{server.url}/openapi.json").text  # sanity: answers are real


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_database_holds_only_token_hashes(server: Server, db_url: str) -> None:
    import hashlib

    claim = submit_and_claim(server)
    con = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    dump = "\n".join(con.iterdump())
    con.close()
    for secret in (claim["token"], server.api_token, server.worker_token):
        assert secret not in dump
    assert hashlib.sha256(claim["token"].encode()).hexdigest() in dump


# ---- limits --------------------------------------------------------------------------


def _jobs(server: Server) -> Any:
    """Every job on ``server`` (a module's: what the test before left is there too)."""
    return server.client().get("/jobs", params={"limit": 500}).json()["items"]


def test_bodies_over_1_mib_get_413_declared_or_streamed(api: Server) -> None:
    server = api
    c = server.client()
    before = _jobs(server)
    big = b'{"name": "' + b"x" * (1024 * 1024) + b'"}'
    r = c.post("/jobs", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413

    def chunks() -> Any:
        for _ in range(3):
            yield b" " * (512 * 1024)

    r = c.post("/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert _jobs(server) == before


def test_the_413_always_arrives_even_when_the_client_closes(api: Server) -> None:
    """Issue 30: the API used to answer 413 and close before reading the rest of the
    body, so a client still sending (urllib says `Connection: close`) often saw
    `Connection reset by peer`. Now it reads and discards the rest (up to a bound) first:
    40 rounds of 2 MiB each, declared and chunked, every one gets the 413 and its detail."""
    server = api
    before = _jobs(server)
    host, port = server.url.removeprefix("http://").split(":")
    big = b" " * (2 * 1024 * 1024)
    headers = {
        "Authorization": f"Bearer {server.api_token}",
        "Content-Type": "application/json",
        "Connection": "close",
    }
    for n in range(40):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            if n % 2:
                chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
                conn.request("POST", "/jobs", body=chunks, headers=headers, encode_chunked=True)
            else:
                conn.request("POST", "/jobs", body=big, headers=headers)
            r = conn.getresponse()
            assert r.status == 413, (n, r.status)
            assert "larger than" in json.loads(r.read())["detail"], n
        finally:
            conn.close()
    assert _jobs(server) == before


def test_an_early_answer_always_arrives_while_the_client_is_still_sending(
    api: Server,
) -> None:
    """A wrong token is answered before the body is read (a code upload's 4 MiB, within its
    limit); answering and closing then reset the connection under the client, which saw
    `Connection reset by peer` instead of the 401. The rest of the body is read first:
    40 rounds, declared and chunked, every one gets its 401."""
    host, port = api.url.removeprefix("http://").split(":")
    big = os.urandom(4 * 1024 * 1024)
    digest = hashlib.sha256(big).hexdigest()
    headers = {
        "Authorization": "Bearer ddpq_u_not-a-token",
        "Content-Type": "application/octet-stream",
        "Connection": "close",
    }
    for n in range(40):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            path = f"/code/blobs/{digest}"
            if n % 2:
                chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
                conn.request("PUT", path, body=chunks, headers=headers, encode_chunked=True)
            else:
                conn.request("PUT", path, body=big, headers=headers)
            r = conn.getresponse()
            assert r.status == 401, (n, r.status)
            r.read()
        finally:
            conn.close()
    missing = api.client().post("/code/missing", json={"digests": [digest]}).json()
    assert missing["missing"] == [digest], "nothing was stored"


def test_metrics_limits_non_finite_values_and_unicode_names(api: Server) -> None:
    claim = submit_and_claim(api)
    jid = claim["job_id"]
    rank0 = api.client(claim["token"])
    names = {"損失": 1.5, "λ/ε": "NaN", "acc 🎯": "Infinity", "grad-norm": "-Infinity"}
    r = rank0.post(f"/jobs/{jid}/metrics", json={"items": [{"step": 1, "values": names}]})
    assert r.status_code == 202, r.text
    user = api.client()
    for path in (f"/jobs/{jid}/metrics", f"/jobs/{jid}"):
        raw = user.get(path).content
        json.loads(raw, parse_constant=lambda c: pytest.fail(f"{c} in {path}"))  # strict JSON
    assert user.get(f"/jobs/{jid}/metrics").json()["items"][0]["values"] == names
    assert user.get(f"/jobs/{jid}").json()["latest_metrics"]["values"] == names
    got = user.get(f"/jobs/{jid}/metrics", params={"name": "損失"}).json()["items"]
    assert got[0]["values"] == {"損失": 1.5}

    def raw(body: str) -> httpx.Response:
        return rank0.post(
            f"/jobs/{jid}/metrics",
            content=body.encode("utf-8", "surrogatepass"),
            headers={"Content-Type": "application/json"},
        )

    bad = [
        '{"items": [{"step": 2, "values": {"loss": NaN}}]}',  # bare tokens: not JSON
        '{"items": [{"step": 2, "values": {"loss": Infinity}}]}',
        '{"items": [{"step": 2, "values": {"loss": "nan"}}]}',
        '{"items": [{"step": 2, "values": {"loss": "1.5"}}]}',
        '{"items": [{"step": 2, "values": {"loss": true}}]}',
        '{"items": [{"step": 2, "values": {"loss": 1e999}}]}',
        '{"items": [{"step": 2, "values": {"": 1}}]}',
        '{"items": [{"step": 2, "values": {"%s": 1}}]}' % ("x" * 201),
        '{"items": [{"step": 2, "values": {"a\\u0000b": 1}}]}',
        '{"items": [{"step": 2, "values": {"a\\nb": 1}}]}',
        '{"items": [{"step": 2, "values": {"\\ud800": 1}}]}',
        '{"items": [{"step": 2, "epoch": "Infinity!", "values": {"a": 1}}]}',
        json.dumps({"items": [{"step": i, "values": {"a": 1}} for i in range(1001)]}),
        json.dumps({"items": [{"step": 2, "values": {f"m{i}": 1 for i in range(101)}}]}),
    ]
    for body in bad:
        r = raw(body)
        assert r.status_code == 422, (body[:80], r.text[:300])
        json.loads(r.content)  # the refusal is valid JSON too
    r = rank0.post(
        f"/jobs/{jid}/metrics",
        content=b'{"items": [{"step": 2, "values": {"\xff": 1}}]}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422 and "UTF-8" in r.text
    assert len(user.get(f"/jobs/{jid}/metrics").json()["items"]) == 1
    for q in ("a\x00b", "x" * 201, "\x07"):
        assert user.get(f"/jobs/{jid}/metrics", params={"name": q}).status_code == 422


def test_ids_and_strings_out_of_range_get_4xx_never_500(api: Server) -> None:
    server = api
    c = server.client()
    before = len(_jobs(server))
    for bad in ("0", "-1", str(2**63), str(2**64), "1e3", "%00", "\uff11", "²", "abc", "1.5"):
        for method, suffix in (("GET", ""), ("POST", "/cancel"), ("GET", "/metrics")):
            r = c.request(method, f"/jobs/{bad}{suffix}")
            assert r.status_code in (404, 422), (bad, suffix, r.text)
    assert c.get(f"/jobs/{2**63 - 1}").status_code == 404
    for cursor in ("²", "-5", "9" * 30, "\x00"):
        assert c.get("/jobs", params={"cursor": cursor}).status_code == 422, cursor
    for name in ("a\x00b", "\ud800"):
        body = json.dumps({**GOOD, "name": name}).encode()
        r = c.post("/jobs", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and "name" in r.text, r.text
    for args in (["a\x00"], ["\udcff"]):
        r = c.post(
            "/jobs",
            content=json.dumps({**GOOD, "args": args}).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 422, r.text
    r = c.post("/jobs", json={**GOOD, "name": "训练 🚀"})
    assert r.status_code == 201 and r.json()["name"] == "训练 🚀"
    assert c.get(f"/jobs/{r.json()['id']}").json()["name"] == "训练 🚀"
    assert len(_jobs(server)) == before + 1


# ---- what a job spec may ask of a worker --------------------------------------------

BAD_ENTRYPOINTS = [
    "/etc/passwd",
    "//etc/passwd",
    "~/x.py",
    "../x.py",
    "a/../../x.py",
    "a/..",
    "..",
    ".",
    "./",
    "C:/x.py",
    "a\\..\\x.py",
    "%2e%2e/x.py",
    "%2Fetc%2Fpasswd",
    "\uff0e\uff0e/x.py",  # fullwidth dots: NFKC makes them ".."
    "\uff0fetc/passwd",  # fullwidth solidus
    "x.py\x00.txt",
    "x\n.py",
    "x\u202e.py",  # right-to-left override
    "",
]
RESERVED_ENV = [
    "DDPQ_JOB_TOKEN",
    "DDPQ_URL",
    "ddpq_url",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PET_RDZV_ENDPOINT",
    "PET_NPROC_PER_NODE",
    "TORCHELASTIC_RUN_ID",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "ld_preload",
    "PYTHONPATH",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "PATH",
    "HOME",
    "BASH_ENV",
    "GLIBC_TUNABLES",
]


def test_spec_rules_for_entrypoint_and_env() -> None:
    for path in BAD_ENTRYPOINTS:
        with pytest.raises(ValidationError, match="entrypoint"):
            JobSpec(entrypoint=path)
    for ok in ("train.py", "sub/dir/train.py", "./train.py", "a..b.py", "模型/训练.py"):
        assert JobSpec(entrypoint=ok).entrypoint == ok
    for name in RESERVED_ENV:
        with pytest.raises(ValidationError, match=name):
            JobSpec(recipe="toy-regression", env={name: "x"})
    allowed = {
        "NCCL_DEBUG": "INFO",
        "OMP_NUM_THREADS": "4",
        "MY_FLAG": "1",
        "TORCH_LOGS": "+dynamo",
    }
    assert JobSpec(recipe="toy-regression", env=allowed).env == allowed
    for bad_name in ("1X", "A-B", "A B", "", "É"):
        with pytest.raises(ValidationError):
            JobSpec(recipe="toy-regression", env={bad_name: "x"})


def test_worker_rechecks_what_it_is_sent(tmp_path: Path) -> None:
    """The API refuses these; the worker refuses them again, never trusting the wire."""
    from worker.executors.runner import JobError

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "ok.py").write_text("")
    outside = tmp_path / "outside.py"
    outside.write_text("")
    (ws / "link.py").symlink_to(outside)
    (ws / "dirlink").symlink_to(tmp_path)
    for entry in ("link.py", "dirlink/outside.py", "../outside.py", str(outside), "%2e%2e/x"):
        with pytest.raises(JobError, match="entrypoint"):
            job_runner(ws, {"entrypoint": entry})._program(ClaimedSpec(entrypoint=entry))
    assert job_runner(ws, {})._program(ClaimedSpec(entrypoint="ok.py", args=["$(id)"])) == [
        str(ws.resolve() / "ok.py"),
        "$(id)",
    ]
    for name in ("LD_PRELOAD", "DDPQ_JOB_TOKEN", "CUDA_VISIBLE_DEVICES", "PET_RDZV_ENDPOINT"):
        with pytest.raises(JobError, match=name):
            job_runner(ws, {"env": {name: "x"}})._env(None)
    env = job_runner(ws, {"env": {"NCCL_DEBUG": "INFO"}})._env(None)
    assert env["NCCL_DEBUG"] == "INFO" and env["CUDA_VISIBLE_DEVICES"] == ""


ARGV_PROGRAM = """
import json, os, sys
out = {"argv": sys.argv[1:], "token": os.environ["DDPQ_JOB_TOKEN"]}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "argv.json"), "w") as f:
    json.dump(out, f)
print("ran")
"""
HOSTILE_ARGS = [
    "; touch pwned-semicolon",
    "$(touch pwned-subshell)",
    "`touch pwned-backtick`",
    "&& touch pwned-and",
    "| touch pwned-pipe",
    "'single' \"double\"",
    "line one\nline two\n",
    "--flag=$HOME",
    "*",
    "",
    " leading space",
    "; rm -rf /",
]


@pytest.mark.torchrun
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_args_arrive_as_literal_argv_and_the_job_token_stays_secret(
    server: Server, start_worker: Any
) -> None:
    worker = start_worker(server)
    (worker.workspace / "argv.py").write_text(ARGV_PROGRAM)
    # A link out of the workspace fails the job before anything runs.
    (worker.workspace / "escape.py").symlink_to(REPO / "examples" / "ddp_plain.py")
    c = server.client()
    escape = c.post("/jobs", json={"entrypoint": "escape.py", "device": "cpu"}).json()
    job = c.post(
        "/jobs", json={"entrypoint": "argv.py", "args": HOSTILE_ARGS, "device": "cpu"}
    ).json()
    failed = terminal(c, escape["id"], timeout=60)
    assert failed["status"] == "failed" and "outside the worker's workspace" in failed["reason"]
    done = terminal(c, job["id"], timeout=120)
    assert done["status"] == "succeeded", (done, c.get(f"/jobs/{job['id']}/logs").text)
    seen = json.loads((worker.workspace / "argv.json").read_text())
    assert seen["argv"] == HOSTILE_ARGS
    assert not list(worker.workspace.glob("pwned*")) and not list(
        worker.workspace.parent.glob("pwned*")
    )
    assert done["spec"]["args"] == HOSTILE_ARGS
    token = seen["token"]
    assert token.startswith("ddpqj_")
    answers = [c.get(p).text for p in ("/jobs", f"/jobs/{job['id']}", f"/jobs/{job['id']}/logs")]
    for text in [*answers, server.log(), worker.log()]:
        assert token not in text


# ---- checkpoints ----------------------------------------------------------------------


class _Payload:
    """Unpickling this runs code: it creates the marker file (a stand-in for a shell)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (str(self.marker), "w"))


def test_a_malicious_checkpoint_is_refused_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from ddpq import train

    ckpt_dir = tmp_path / "job-1"
    ckpt_dir.mkdir()
    marker = tmp_path / "marker"
    path = ckpt_dir / "step-000000005.pt"
    torch.save({"model": _Payload(marker)}, path)
    assert not marker.exists()
    monkeypatch.setenv("DDPQ_CHECKPOINT_DIR", str(ckpt_dir))
    monkeypatch.delenv("DDPQ_RESUME_FROM", raising=False)
    assert train.latest_checkpoint() == path
    with pytest.raises(pickle.UnpicklingError):
        train.load_checkpoint()
    assert not marker.exists()
    # The payload is real: plain unpickling runs it.
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof))).close()
    assert proof.exists()
    # A link planted in the directory is not followed out of it.
    path.unlink()
    (ckpt_dir / "step-000000009.pt").symlink_to(tmp_path / "elsewhere.pt")
    (tmp_path / "elsewhere.pt").write_bytes(b"")
    assert train.latest_checkpoint() is None


def test_every_torch_load_in_the_project_is_weights_only() -> None:
    calls = 0
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for py in (REPO / f for f in files):
        for node in ast.walk(ast.parse(py.read_text(), str(py))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                calls += 1
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("weights_only"), ast.Constant), (py, node.lineno)
                assert kw["weights_only"].value is True, (py, node.lineno)  # type: ignore[attr-defined]
    assert calls >= 1
    # The API never opens a checkpoint: nothing in service/ even imports torch.
    for py in (REPO / "service").rglob("*.py"):
        assert "import torch" not in py.read_text(), py


def test_checkpoint_registration_stays_in_the_job_directory_and_serves_no_file(
    api: Server, tmp_path: Path
) -> None:
    claim = submit_and_claim(api)
    jid, root = claim["job_id"], claim["checkpoint_dir"]
    rank0 = api.client(claim["token"])
    for bad in (
        f"{root}/../job-{jid + 1}/x.pt",
        f"{root}/./../../etc/passwd",
        f"{root}\x00/x.pt",
        f"{root}2/x.pt",
        "x.pt",
        root + "/",
    ):
        r = rank0.post(f"/jobs/{jid}/checkpoints", json={"path": bad, "step": 1})
        assert r.status_code == 422, (bad, r.text)
    r = rank0.post(f"/jobs/{jid}/checkpoints", json={"path": f"{root}/a.pt", "step": 1})
    assert r.status_code == 201
    answer = api.client().get(f"/jobs/{jid}/checkpoints").json()
    # What a checkpoint is, where it stands (retention), never its file's contents (once
    # sent for a fork or a download, the id of the snapshot that holds them: read as any
    # job's outputs are, by the team, docs/sharing.md).
    assert set(answer["items"][0]) == {
        "id",
        "path",
        "step",
        "epoch",
        "attempt",
        "created_at",
        "metrics",
        "keep",
        "bytes",
        "state",
        "note",
        "pruned_at",
        "expires_at",
        "worker",
        "kind",
        "snapshot",
        "sending",
        "send_problem",
    }


# ---- refusing to serve an open job launcher -----------------------------------------


def test_tokens_must_be_strong_off_loopback(tmp_path: Path) -> None:
    strong = "k3Y9-qv8_Zx2LmN4pR7sT1wE"
    weak = [
        "",
        "   ",
        "short",
        "changeme",
        "secret",
        "password",
        "replace-me-with-a-random-token",
        "replace-me-with-another-random-token",
        "a" * 40,
        "abababababababababab",
    ]
    for value in weak:
        settings = Settings(data_dir=tmp_path, api_token=value, worker_token=strong + "x")
        with pytest.raises(TokenError, match="DDPQ_API_TOKEN"):
            resolve_tokens(settings, "0.0.0.0")
    with pytest.raises(TokenError, match="differ"):
        resolve_tokens(Settings(data_dir=tmp_path, api_token=strong, worker_token=strong), "::")
    assert resolve_tokens(
        Settings(data_dir=tmp_path, api_token=strong, worker_token=strong + "x"), "0.0.0.0"
    ) == (strong, strong + "x")
    # Loopback without tokens: generated, private.
    api, worker = resolve_tokens(Settings(data_dir=tmp_path / "lo"), "127.0.0.1")
    assert len(api) >= 32 and api != worker
    assert (tmp_path / "lo" / "api-token").stat().st_mode & 0o077 == 0
    assert not list(tmp_path.glob("api-token"))


def test_serve_on_a_reachable_address_with_the_example_tokens_exits(tmp_path: Path) -> None:
    env = dict(
        line.split("=", 1)
        for line in (REPO / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    r = serve_on_a_reachable_address(
        {
            "DDPQ_DATA_DIR": str(tmp_path),
            "DDPQ_API_TOKEN": env["DDPQ_API_TOKEN"],
            "DDPQ_WORKER_TOKEN": env["DDPQ_WORKER_TOKEN"],
            "DDPQ_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        },
    )
    assert r.returncode != 0
    assert "DDPQ_API_TOKEN" in r.stderr and "placeholder" in r.stderr, r.stderr
    assert not (tmp_path / "x.db").exists()  # refused before touching anything
