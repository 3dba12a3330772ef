"""Secrets for jobs (issue 41): a user's values, sealed at rest, that reach their own
jobs' ranks and nothing else (docs/sharing.md#secrets, docs/security.md). Both databases.

- service/secrets.py on the database alone: a value is sealed for its owner and name and
  opens only with its key (a wrong key, a moved ciphertext: a clear error naming the
  secret), a claim carries the values as they are now (a retry gets the current one) or
  the words naming what is gone, a rotated key seals again, the audit names names only;
- the routes: each user manages their own, an admin lists names, no answer and no 422
  ever quotes a value, a Slurm attempt's token fetches its job's values and a worker's
  does not;
- one job end to end: bob's secret reaches his job's rank (its sha256 in the log) and is
  in no answer to alice or the admin, no log, the audit trail, the worker's trace, the
  warm process that forks later jobs, or the database in clear; alice cannot name it;
  a job whose secret was deleted before it ran fails naming it; `ddpq submit` warns of a
  secret-looking `--env`;
- the worker's pure parts: the ranks' environment, the warm process's, a Slurm plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets as random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import create_engine, inspect, select, text

from ddpq.jobspec import ClaimedSpec
from ddpq.messages import ClaimedJob
from ddpq.rules import MAX_SECRET_BYTES, secret_like
from service import secrets
from service.config import Settings, TokenError, resolve_secrets_keys
from service.db import Database
from service.errors import Conflict, Forbidden, Invalid, NotFound
from service.models import AuditEvent, Job, Secret
from service.users import Principal
from tests.conftest import Server, Worker, run_ddpq, start_server, stop_server, terminal, wait_for
from tests.test_bridge_protocol import _claim, _claim_of, _register_bridge
from worker.executors import slurm
from worker.starting import torchrun, warm

KEY, OTHER = b"k" * 16 + b"\x01" * 16, bytes(range(32))
BOB = Principal("bob", "member")
ALICE = Principal("alice", "member")
ADMIN = Principal("admin", "admin")

# The job: whether the variable is set and its sha256, never the value itself.
PROBE = """
import hashlib, os
v = os.environ.get("WANDB_API_KEY")
print("secret-probe", "set" if v else "unset", hashlib.sha256((v or "").encode()).hexdigest())
"""


def sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _job(db: Database, owner: str, names: list[str]) -> ClaimedJob:
    """A queued job of ``owner``'s naming ``names``, as a claim of it would carry it."""
    with db.write() as s:
        job = Job(
            status="queued",
            spec={"entrypoint": "t.py", "secrets": names},
            nproc_per_node=1,
            device="cpu",
            max_attempts=1,
            owner=owner,
        )
        s.add(job)
        s.flush()
        job_id = job.id
    return _claim_of(job_id=job_id, spec={"secrets": names}, nnodes=1)


# ---- service/secrets.py on the database -----------------------------------------------------


def test_a_value_is_sealed_for_its_owner_and_name_and_opens_only_with_its_key(
    db: Database,
) -> None:
    keys = secrets.Keyring(KEY)
    value = "wandb-" + random.token_hex(16)
    listed = secrets.put(db, keys, BOB, "WANDB_API_KEY", value)
    assert set(listed) == {"name", "owner", "created_at", "updated_at"}
    with db.read() as s:
        row = s.get(Secret, ("bob", "WANDB_API_KEY"))
        assert row is not None
        sealed, kid = row.sealed, row.key_id
    assert value.encode() not in sealed and kid == keys.current_id == secrets.key_id(KEY)
    assert secrets.values(db, keys, "bob", ["WANDB_API_KEY"]) == {"WANDB_API_KEY": value}
    # Another key: refused with the secret's name and the keys' ids, never the value.
    with pytest.raises(secrets.SecretUnreadable, match="WANDB_API_KEY of bob") as wrong:
        secrets.values(db, secrets.Keyring(OTHER), "bob", ["WANDB_API_KEY"])
    assert kid in str(wrong.value) and value not in str(wrong.value)
    # Bob's ciphertext copied into alice's row (or another name) does not open.
    with db.write() as s:
        s.add(Secret(owner="alice", name="WANDB_API_KEY", key_id=kid, sealed=sealed))
        s.add(Secret(owner="bob", name="HF_TOKEN", key_id=kid, sealed=sealed))
    for owner, name in (("alice", "WANDB_API_KEY"), ("bob", "HF_TOKEN")):
        with pytest.raises(secrets.SecretUnreadable, match="does not open"):
            secrets.values(db, keys, owner, [name])


def test_members_keep_their_own_admins_list_names_and_the_audit_names_names_only(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = secrets.Keyring(KEY)
    value = "tok-" + random.token_hex(16)
    created = secrets.put(db, keys, BOB, "HF_TOKEN", value)
    replaced = secrets.put(db, keys, BOB, "HF_TOKEN", value + "2")
    assert replaced["created_at"] == created["created_at"] <= replaced["updated_at"]
    assert [s["name"] for s in secrets.listing(db, BOB, None)] == ["HF_TOKEN"]
    assert secrets.listing(db, ALICE, None) == []
    with pytest.raises(Forbidden) as refused:
        secrets.listing(db, ALICE, "bob")
    refused_why = refused.value.detail
    assert [s["name"] for s in secrets.listing(db, ADMIN, "bob")] == ["HF_TOKEN"]
    with pytest.raises(NotFound):
        secrets.remove(db, ALICE, "HF_TOKEN")  # alice has none of that name
    # The rules: a name a job's env could set, none ddpq sets; a bounded value.
    for name, value_, where in (
        ("DDPQ_JOB_TOKEN", "x", "name"),
        ("CUDA_VISIBLE_DEVICES", "x", "name"),
        ("NOT A NAME", "x", "name"),
        ("OK", "", "value"),
        ("OK", "a\x00b", "value"),
        ("OK", "x" * (MAX_SECRET_BYTES + 1), "value"),
    ):
        with pytest.raises(Invalid) as bad:
            secrets.put(db, keys, BOB, name, value_)
        assert bad.value.loc[-1] == where, bad.value.loc
        assert len(value_) < 2 or value_[:20] not in bad.value.detail  # never quoted
    monkeypatch.setattr("ddpq.rules.MAX_USER_SECRETS", 2)
    secrets.put(db, keys, BOB, "SECOND", "x")
    with pytest.raises(Conflict, match="keeps 2 secrets"):
        secrets.put(db, keys, BOB, "THIRD", "x")
    secrets.put(db, keys, BOB, "SECOND", "y")  # replacing is no new one
    secrets.remove(db, BOB, "SECOND")
    with pytest.raises(Invalid, match="no secret named NOPE"):
        secrets.require(db, "bob", ["HF_TOKEN", "NOPE"])
    secrets.require(db, "bob", ["HF_TOKEN"])
    with db.read() as s:
        audit = [(e.actor, e.action, e.target, e.detail) for e in s.scalars(select(AuditEvent))]
    assert audit == [
        ("bob", "secret.set", "secret HF_TOKEN", None),
        ("bob", "secret.set", "secret HF_TOKEN", None),
        # A member asking for another's names is refused, and the trail says who tried.
        ("alice", "refused.secret.list", "secrets of bob", {"why": refused_why}),
        ("bob", "secret.set", "secret SECOND", None),
        ("bob", "secret.set", "secret SECOND", None),
        ("bob", "secret.delete", "secret SECOND", None),
    ]


def test_a_claim_carries_the_values_as_they_are_now_or_names_what_is_gone(db: Database) -> None:
    keys = secrets.Keyring(KEY)
    secrets.put(db, keys, BOB, "WANDB_API_KEY", "v1")
    secrets.put(db, keys, BOB, "HF_TOKEN", "h1")
    claim = _job(db, "bob", ["WANDB_API_KEY", "HF_TOKEN"])
    got = secrets.for_claim(db, keys, claim)
    assert got.secrets == {"WANDB_API_KEY": "v1", "HF_TOKEN": "h1"} and not got.secrets_problem
    assert "v1" not in repr(got) and "v1" not in str(got)  # never in a log line of it
    # A retry (or a resubmit) is claimed anew: the value of now.
    secrets.put(db, keys, BOB, "WANDB_API_KEY", "v2")
    assert secrets.for_claim(db, keys, claim).secrets["WANDB_API_KEY"] == "v2"
    # Deleted since the submit: no value, the words that name it.
    secrets.remove(db, BOB, "HF_TOKEN")
    gone = secrets.for_claim(db, keys, claim)
    assert gone.secrets == {} and "HF_TOKEN" in (gone.secrets_problem or "")
    assert "gone" in (gone.secrets_problem or "") and "v2" not in (gone.secrets_problem or "")
    # Under a key this API lacks: the same, naming the secret.
    wrong = secrets.for_claim(db, secrets.Keyring(OTHER), _job(db, "bob", ["WANDB_API_KEY"]))
    assert wrong.secrets == {} and "WANDB_API_KEY of bob" in (wrong.secrets_problem or "")
    # A spec naming none: the claim as it was, no database read.
    plain = _claim_of(spec={})
    assert secrets.for_claim(db, keys, plain) is plain


def test_a_rotated_key_seals_every_secret_again_at_start(db: Database) -> None:
    secrets.put(db, secrets.Keyring(KEY), BOB, "WANDB_API_KEY", "v")
    rotated = secrets.Keyring(OTHER, old=(KEY,))
    assert secrets.values(db, rotated, "bob", ["WANDB_API_KEY"]) == {"WANDB_API_KEY": "v"}
    assert secrets.rekey(db, rotated) == 1
    assert secrets.rekey(db, rotated) == 0
    alone = secrets.Keyring(OTHER)  # the old key dropped
    assert secrets.values(db, alone, "bob", ["WANDB_API_KEY"]) == {"WANDB_API_KEY": "v"}


def test_the_key_is_resolved_as_the_tokens_are(tmp_path: Path) -> None:
    generated = resolve_secrets_keys(Settings(data_dir=tmp_path), "127.0.0.1")
    key_file = tmp_path / "secrets-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    again = resolve_secrets_keys(Settings(data_dir=tmp_path), "127.0.0.1")
    assert generated.secrets_key and again.secrets_key
    assert generated.secrets_key.get_secret_value() == again.secrets_key.get_secret_value()
    with pytest.raises(TokenError, match="DDPQ_SECRETS_KEY is not set"):
        resolve_secrets_keys(Settings(data_dir=tmp_path / "no"), "0.0.0.0")
    assert not (tmp_path / "no").exists()
    for bad in ("short", "not base64 at all!!", "AAAA"):
        with pytest.raises(TokenError, match="DDPQ_SECRETS_KEY is not base64 of 32 bytes"):
            resolve_secrets_keys(Settings(data_dir=tmp_path, secrets_key=SecretStr(bad)), "::1")
    zeros = SecretStr("A" * 43 + "=")  # 32 zero bytes: a key, not a random one
    with pytest.raises(TokenError, match="distinct"):
        resolve_secrets_keys(Settings(data_dir=tmp_path, secrets_key=zeros), "0.0.0.0")
    import base64

    good = base64.b64encode(OTHER).decode()
    set_ = resolve_secrets_keys(Settings(data_dir=tmp_path, secrets_key=SecretStr(good)), "0.0.0.0")
    assert secrets.Keyring.of(set_).current == OTHER
    old = base64.urlsafe_b64encode(KEY).decode()
    both = Settings(
        data_dir=tmp_path, secrets_key=SecretStr(good), secrets_old_keys=SecretStr(f" {old},")
    )
    assert secrets.Keyring.of(resolve_secrets_keys(both, "0.0.0.0")).old == (KEY,)


# ---- the routes ---------------------------------------------------------------------------


def add(server: Server, name: str) -> str:
    r = server.client().post("/users", json={"name": name})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


def test_the_routes_keep_each_users_own_and_never_answer_a_value(server: Server) -> None:
    admin, bob = server.client(), server.client(add(server, "bob"))
    alice = server.client(add(server, "alice"))
    value = "v-" + random.token_hex(16)
    r = bob.put("/secrets/WANDB_API_KEY", json={"value": value})
    assert r.status_code == 200 and r.json()["name"] == "WANDB_API_KEY", r.text
    seen = [r.text]
    # Refusals name the field and the reason, never quoting the value (a 422 of FastAPI's
    # would echo the body).
    for path, body, where in (
        ("/secrets/DDPQ_JOB_TOKEN", {"value": value}, "name"),
        ("/secrets/WANDB_API_KEY", {"value": value + "\x00"}, "body"),
        ("/secrets/WANDB_API_KEY", {"value": value * 2000}, "value"),
        ("/secrets/WANDB_API_KEY", {"value": value, "extra": value}, "extra"),
        ("/secrets/WANDB_API_KEY", {"valeu": value}, "value"),
    ):
        r = bob.put(path, json=body)
        assert r.status_code == 422 and where in r.text, (path, r.text)
        seen.append(r.text)
    r = bob.put("/secrets/X", content=b'{"value": "\xff\xfe"}')
    assert r.status_code == 422 and "UTF-8" in r.text, r.text
    assert bob.put("/secrets/X", content=b"[").status_code == 422
    seen += [bob.get("/secrets").text, admin.get("/secrets", params={"user": "bob"}).text]
    assert [s["name"] for s in admin.get("/secrets", params={"user": "bob"}).json()["items"]] == [
        "WANDB_API_KEY"
    ]
    assert alice.get("/secrets").json() == {"items": []}
    assert alice.get("/secrets", params={"user": "bob"}).status_code == 403
    assert alice.delete("/secrets/WANDB_API_KEY").status_code == 404
    # Alice cannot name bob's secret; a secret is not also a plain env variable.
    refused = alice.post("/jobs", json={"entrypoint": "t.py", "secrets": ["WANDB_API_KEY"]})
    assert refused.status_code == 422 and "alice has no secret named WANDB_API_KEY" in refused.text
    both = {"entrypoint": "t.py", "secrets": ["WANDB_API_KEY"], "env": {"WANDB_API_KEY": "x"}}
    assert bob.post("/jobs", json=both).status_code == 422
    for names in (["DDPQ_URL"], ["A", "A"], ["A"] * 40):
        assert bob.post("/jobs", json={"entrypoint": "t.py", "secrets": names}).status_code == 422
    # A job on a worker: its claim carries the value (worker token); the job's own token
    # fetches nothing (its worker gave its ranks the values already).
    from tests.helpers import register

    register(server, "hand")
    job = bob.post("/jobs", json={"entrypoint": "t.py", "secrets": ["WANDB_API_KEY"]}).json()
    assert job["spec"]["secrets"] == ["WANDB_API_KEY"]
    r = server.client("worker").post(
        "/workers/claim", json={"name": "hand", "free_cpu_slots": 8, "free_gpus": [], "wait_s": 5}
    )
    assert r.json()["secrets"] == {"WANDB_API_KEY": value}, r.text
    as_job = server.client(r.json()["token"])
    refused = as_job.get(f"/jobs/{job['id']}/secrets")
    assert refused.status_code == 409 and "gives its ranks" in refused.text
    assert bob.get(f"/jobs/{job['id']}/secrets").status_code == 403  # a user token: no
    # A Slurm bridge's attempt: its nodes fetch them with the job token.
    _register_bridge(server)
    slurm_job = bob.post("/jobs", json={"entrypoint": "t.py", "secrets": ["WANDB_API_KEY"]})
    claim = _claim(server)
    assert claim is not None and claim["job_id"] == slurm_job.json()["id"]
    node = server.client(claim["token"])
    assert node.get(f"/jobs/{claim['job_id']}/secrets").json() == {
        "values": {"WANDB_API_KEY": value}
    }
    assert node.get(f"/jobs/{job['id']}/secrets").status_code == 403  # another job's
    from worker.slurmnode import NodeAPI  # what each node of the attempt runs

    api = NodeAPI(server.url, claim["token"], 0)
    try:
        assert api.secrets(claim["job_id"]) == {"WANDB_API_KEY": value}
    finally:
        api.close()
    seen += [
        bob.get("/jobs").text,
        alice.get(f"/jobs/{job['id']}").text,
        admin.get("/audit").text,
        httpx.get(f"{server.url}/openapi.json").text,
    ]
    assert bob.delete("/secrets/WANDB_API_KEY").status_code == 204
    assert bob.delete("/secrets/WANDB_API_KEY").status_code == 404
    for answer in seen:
        assert value not in answer, answer[:300]
    assert value not in server.log()


# ---- end to end -----------------------------------------------------------------------------


def _zygotes(worker: Worker) -> list[int]:
    """The worker's warm processes (worker.zygote), by their parent."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        if ppid == worker.proc.pid and b"worker.zygote" in cmdline:
            found.append(int(entry.name))
    return found


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Whether a process's writable memory (heap, stacks, anonymous maps) holds ``needle``."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5].startswith("/")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except (OSError, OverflowError, ValueError):
                continue
    return False


def _database_dump(db_url: str) -> str:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return repr(
                [
                    [
                        tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                        for row in conn.execute(text(f'SELECT * FROM "{table}"'))
                    ]
                    for table in inspect(conn).get_table_names()
                ]
            )
    finally:
        engine.dispose()


def test_a_secret_reaches_its_owners_rank_and_nothing_else(
    db_url: str, tmp_path: Path, start_worker: Callable[..., Worker]
) -> None:
    server = start_server(db_url, tmp_path / "api")
    try:
        _end_to_end(server, db_url, tmp_path, start_worker)
    finally:
        stop_server(server)


def _end_to_end(
    server: Server, db_url: str, tmp_path: Path, start_worker: Callable[..., Worker]
) -> None:
    admin = server.client()
    alice_token, bob_token = add(server, "alice"), add(server, "bob")
    alice, bob = server.client(alice_token), server.client(bob_token)
    value, gone = "wandb-" + random.token_hex(20), "gone-" + random.token_hex(20)
    as_bob = {"DDPQ_URL": server.url, "DDPQ_TOKEN": bob_token}
    said: list[str] = []

    def cli(*args: str, ok: bool = True, **kw: Any) -> Any:
        r = run_ddpq(*args, env=as_bob, **kw)
        assert (r.returncode == 0) == ok, r.stdout + r.stderr
        said.append(r.stdout + r.stderr)
        return r

    # Set from stdin (never argv, which `ps` shows).
    cli("secrets", "set", "WANDB_API_KEY", input=value + "\n")
    cli("secrets", "set", "OLD_TOKEN", input=gone)
    assert cli("secrets", "set", "DDPQ_X", ok=False, input="v").returncode == 2
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "probe.py").write_text(PROBE)
    # A secret-looking plain variable: submitted, with the warning that points at secrets.
    r = cli(
        "submit", "--entrypoint", "probe.py", "--secret", "WANDB_API_KEY",
        "--env", "MY_API_TOKEN=shown-to-all", "--json", cwd=proj,
    )  # fmt: skip
    assert "MY_API_TOKEN looks like a secret" in r.stderr, r.stderr
    assert "ddpq secrets set MY_API_TOKEN" in r.stderr and "--secret MY_API_TOKEN" in r.stderr
    job = json.loads(r.stdout)
    assert job["spec"]["secrets"] == ["WANDB_API_KEY"]
    # Alice cannot name bob's secret (the CLI says the API's words).
    r = run_ddpq(
        "submit", "--entrypoint", "probe.py", "--secret", "WANDB_API_KEY", cwd=proj,
        env={"DDPQ_URL": server.url, "DDPQ_TOKEN": alice_token},
    )  # fmt: skip
    assert r.returncode == 1 and "alice has no secret named WANDB_API_KEY" in r.stderr, r.stderr
    # A job whose secret its owner deletes before a worker takes it fails, naming it.
    doomed = bob.post(
        "/jobs",
        json={"entrypoint": "probe.py", "code": job["spec"]["code"], "secrets": ["OLD_TOKEN"]},
    ).json()
    cli("secrets", "rm", "OLD_TOKEN")
    trace = tmp_path / "trace.jsonl"
    worker = start_worker(server, "--trace", str(trace))
    done = terminal(bob, job["id"])
    assert done["status"] == "succeeded", done
    failed = terminal(bob, doomed["id"])
    assert failed["status"] == "failed" and "OLD_TOKEN" in failed["reason"], failed
    assert "gone" in failed["reason"] and failed["attempt"] == 1, failed
    log = bob.get(f"/jobs/{job['id']}/logs").text
    assert f"secret-probe set {sha(value)}" in log, log
    assert "OLD_TOKEN" in bob.get(f"/jobs/{doomed['id']}/logs").text
    # The warm process that forks later jobs holds none of it, in its environment or memory.
    if os.environ.get("DDPQ_TEST_LAUNCHER") != "torchrun" and os.geteuid() == 0:
        zygotes = wait_for(lambda: _zygotes(worker), 10, "the worker's warm process")
        for pid in zygotes:
            assert value.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
            assert _memory_holds(pid, b"DDPQ_LAUNCH_ID="), "the scan reads its memory"
            assert not _memory_holds(pid, value.encode()), f"warm process {pid} holds it"
    # Nowhere else: no answer to alice or the admin, no log, no trace, no audit row, no
    # row of the database in clear.
    wait_for(trace.exists, 30, "the worker's trace")
    for path in (
        "/jobs", f"/jobs/{job['id']}", f"/jobs/{job['id']}/logs", f"/jobs/{job['id']}/events",
        f"/jobs/{job['id']}/attempts", f"/jobs/{doomed['id']}", "/secrets",
    ):  # fmt: skip
        said.append(alice.get(path).text)
    audit = admin.get("/audit").json()["items"]
    listed = cli("secrets", "ls").stdout
    assert "WANDB_API_KEY" in listed and "OLD_TOKEN" not in listed
    cli("status", str(job["id"]))
    said += [
        admin.get("/secrets", params={"user": "bob"}).text,
        json.dumps(audit),
        httpx.get(f"{server.url}/openapi.json").text,
        worker.log(),
        server.log(),
        trace.read_text(),
    ]
    assert [(e["action"], e["target"]) for e in audit if e["action"].startswith("secret.")] == [
        ("secret.delete", "secret OLD_TOKEN"),
        ("secret.set", "secret OLD_TOKEN"),
        ("secret.set", "secret WANDB_API_KEY"),
    ]
    dump = _database_dump(db_url)
    assert "WANDB_API_KEY" in dump  # the name is there; the value only sealed
    for text_ in [*said, dump]:
        for secret in (value, gone):
            assert secret not in text_, re.sub(r"\s+", " ", text_)[:500]


# ---- the worker's pure parts ----------------------------------------------------------------


def test_the_worker_s_own_directories_never_reach_a_job_and_accelerate_distributes_on_cpu() -> None:
    at = torchrun.Placement("http://api", "/ckpt/job-12", "DDPQ_LAUNCH_ID", "w@x/12/3")
    worker_env = {
        "XDG_CONFIG_HOME": "/home/w/.config", "XDG_RUNTIME_DIR": "/run/user/1000",
        "XDG_CACHE_HOME": "/home/w/.cache", "PATH": "/bin",
    }  # fmt: skip
    cpu = torchrun.environment(worker_env, _claim_of(spec={}, device="cpu"), at)
    assert not [k for k in cpu if k.startswith("XDG_")]  # the worker's login lives there
    # Without it accelerate runs each CPU rank alone (DistributedType.NO), silently.
    assert cpu["ACCELERATE_USE_CPU"] == "1"
    assert "ACCELERATE_USE_CPU" not in torchrun.environment(worker_env, _claim_of(spec={}), at)
    said = _claim_of(spec={"env": {"ACCELERATE_USE_CPU": "0"}}, device="cpu")
    assert torchrun.environment(worker_env, said, at)["ACCELERATE_USE_CPU"] == "0"


def test_the_ranks_get_the_secrets_and_nothing_of_ddpqs_is_replaced() -> None:
    claim = _claim_of(spec={"env": {"A": "1"}, "secrets": ["WANDB_API_KEY", "HF_TOKEN"]})
    claim = claim.model_copy(update={"secrets": {"WANDB_API_KEY": "w", "HF_TOKEN": "h"}})
    at = torchrun.Placement("http://api", "/ckpt/job-12", "DDPQ_LAUNCH_ID", "w@x/12/3")
    env = torchrun.environment({"HF_TOKEN": "the-worker's", "PATH": "/bin"}, claim, at)
    assert env["WANDB_API_KEY"] == "w" and env["HF_TOKEN"] == "h" and env["A"] == "1"
    # Without the job's own, the worker's credentials stay the worker's, whatever their
    # prefix; its settings pass.
    worker_env = {
        "HF_TOKEN": "t", "HF_HUB_TOKEN": "t", "HF_API_KEY": "k", "TORCH_AUTH": "a",
        "NCCL_SECRET": "s", "HF_HUB_OFFLINE": "1", "TORCH_KEYS_ALLOWED": "1", "PATH": "/bin",
    }  # fmt: skip
    bare = torchrun.environment(worker_env, _claim_of(spec={}), at)
    assert {k for k in worker_env if k in bare} == {"HF_HUB_OFFLINE", "TORCH_KEYS_ALLOWED", "PATH"}
    assert env["DDPQ_JOB_TOKEN"] == "secret-job-token"
    assert torchrun.secrets_problem(claim) is None
    forged = claim.model_copy(update={"secrets": {"DDPQ_JOB_TOKEN": "x"}})
    with pytest.raises(Exception, match="DDPQ_JOB_TOKEN is set by ddpq") as refused:
        torchrun.environment({}, forged, at)
    assert "x" not in str(refused.value).split("DDPQ_JOB_TOKEN")[0]
    lacking = claim.model_copy(update={"secrets": {"WANDB_API_KEY": "w"}})
    assert "HF_TOKEN" in (torchrun.secrets_problem(lacking) or "")
    told = claim.model_copy(update={"secrets": {}, "secrets_problem": "secret HF_TOKEN is gone"})
    assert torchrun.secrets_problem(told) == "secret HF_TOKEN is gone"
    # The warm process that forks every later job never holds one (HF_TOKEN would pass the
    # allow-list), and one read as the interpreter starts takes a cold torchrun.
    assert "HF_TOKEN" not in warm.zygote_env(env, claim.spec, 2)
    assert "WANDB_API_KEY" not in warm.zygote_env(env, claim.spec, 2)
    assert warm.choose(ClaimedSpec(secrets=["TORCH_HUB_TOKEN"]), "warm")[0] == "torchrun"
    # A Slurm attempt's plan (its batch script, which Slurm keeps) carries none of them.
    plan = slurm.plan(claim, ["t.py"], env, "ddpq bridge b -", "warm")
    assert '"w"' not in plan and '"h"' not in plan and "the-worker's" not in plan
    assert json.loads(plan)["claim"]["spec"]["secrets"] == ["WANDB_API_KEY", "HF_TOKEN"]


def test_secret_looking_env_names() -> None:
    for name in ("WANDB_API_KEY", "hf_token", "GITHUB_TOKEN_X", "MY_SECRET", "DB_PASSWORD"):
        assert secret_like(name), name
    for name in ("KEYBOARD", "NCCL_DEBUG", "OMP_NUM_THREADS", "MONKEY"):
        assert not secret_like(name), name
