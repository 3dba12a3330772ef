"""ddpq.errors: one tree for the client's, the worker's and ddpq.train's errors, each
naming what was asked and what was answered, and the CLI's one map of it to exit codes.
Cheap: no servers (the API's answers come from httpx.MockTransport)."""

from __future__ import annotations

import importlib
import json
import pickle
import pkgutil
from collections.abc import Callable, Iterator
from types import ModuleType

import httpx
import pytest

import ddpq
import worker
from ddpq import config, errors
from ddpq.cli import base
from ddpq.client import Client
from ddpq.errors import (
    ApiBadAnswer,
    ApiError,
    ApiRefused,
    ApiUnavailable,
    ApiUnreachable,
    CodeError,
    ConfigError,
    DdpqError,
    SnapshotError,
    WorkerError,
)
from worker.edges.api import WorkerAPI

URL = "http://api.test:8000"


def _modules() -> Iterator[ModuleType]:
    """Every module of ddpq/ and worker/ (not a __main__, which runs on import)."""
    for package in (ddpq, worker):
        yield package
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                yield importlib.import_module(info.name)


def _error_classes() -> list[type[Exception]]:
    """The exception classes ddpq/ and worker/ define (KeyboardInterrupt's kind, such as
    ddpq.cli.live.Interrupted, is Ctrl-C, not an error)."""
    found = {
        cls
        for module in _modules()
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, Exception)
        and cls.__module__ == module.__name__
    }
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


ERRORS = _error_classes()


def test_every_error_of_the_client_and_the_worker_is_a_ddpq_error() -> None:
    assert DdpqError in ERRORS and len(ERRORS) > 15, ERRORS
    outside = [f"{c.__module__}.{c.__qualname__}" for c in ERRORS if not issubclass(c, DdpqError)]
    assert outside == [], f"give these ddpq.errors' base: {outside}"


def test_no_two_public_error_classes_share_a_name() -> None:
    seen: dict[str, str] = {}
    for cls in ERRORS:
        if cls.__name__.startswith("_"):
            continue
        where = f"{cls.__module__}.{cls.__qualname__}"
        assert cls.__name__ not in seen, (where, seen[cls.__name__])
        seen[cls.__name__] = where


def test_the_three_client_families_are_one() -> None:
    from ddpq import client, train  # noqa: F401 - train raises ddpq.errors' (below)
    from worker.edges import api

    assert client.ApiError is ApiError
    # The worker speaks the client's family, under the family's own names.
    assert not hasattr(api, "Refused") and not hasattr(api, "Unavailable")
    assert issubclass(ApiUnreachable, ApiUnavailable) and issubclass(ApiRefused, ApiError)
    assert issubclass(SnapshotError, ValueError)  # as the snapshot's refusal was


# ---- what was asked, what was answered ---------------------------------------------------


def test_an_answer_says_the_request_its_status_and_the_apis_detail() -> None:
    body = json.dumps({"detail": [{"loc": ["body", "world_size"], "msg": "too big"}]})
    e = errors.answer_error("POST", f"{URL}/jobs?strict=true", 422, body)
    assert type(e) is ApiRefused and (e.method, e.path, e.status) == ("POST", "/jobs", 422)
    assert str(e) == "POST /jobs: HTTP 422: world_size: too big"
    for status in (429, 500, 503):
        e = errors.answer_error("GET", f"{URL}/jobs/3", status, '{"detail": "not now"}')
        assert type(e) is ApiUnavailable and str(e) == f"GET /jobs/3: HTTP {status}: not now"
    page = "<html>" + "x" * 2000
    e = errors.answer_error("GET", f"{URL}/jobs", 404, page)
    assert type(e) is ApiRefused and len(e.detail) < 600 and e.detail.startswith("<html>")


def test_no_answer_says_the_url_tried_and_why() -> None:
    e = errors.no_answer("GET", f"{URL}/jobs", httpx.ConnectError("[Errno 111]\n refused"))
    assert isinstance(e, ApiUnavailable) and e.status is None
    assert str(e) == f"GET {URL}/jobs: no answer (ConnectError: [Errno 111] refused)"


def test_an_api_error_pickles_as_made() -> None:
    e = errors.answer_error("POST", f"{URL}/jobs", 409, '{"detail": "taken"}')
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is ApiRefused and str(again) == str(e) and again.status == 409


def _mock(answer: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(base_url=URL, transport=httpx.MockTransport(answer))


def _refuse(request: httpx.Request) -> httpx.Response:
    return httpx.Response(409, json={"detail": f"{request.url.path} says no"})


def _down(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"detail": "database unavailable"})


def _away(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _not_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text="<html>a proxy page</html>")


def test_the_client_raises_the_tree() -> None:
    c = Client(URL, "t" * 30)
    for answer, kind, said in (
        (_refuse, ApiRefused, "GET /jobs/7: HTTP 409: /jobs/7 says no"),
        (_down, ApiUnavailable, "GET /jobs/7: HTTP 503: database unavailable"),
        (_away, ApiUnreachable, f"GET {URL}/jobs/7: no answer (ConnectError: connection"),
        (_not_json, ApiBadAnswer, "GET /jobs/7: HTTP 200: not the ddpq API's JSON: '<html>"),
    ):
        c._http.client = _mock(answer)
        with pytest.raises(kind) as e:
            c.job(7)
        assert type(e.value) is kind and str(e.value).startswith(said), str(e.value)
    c._http.client = _mock(_away)
    with pytest.raises(ApiUnreachable, match=r"GET .*/jobs/7/logs: no answer"):
        list(c.follow_logs(7))


def test_the_worker_raises_the_tree() -> None:
    api = WorkerAPI(URL, "w" * 30, "host-1")
    for answer, kind, status in ((_refuse, ApiRefused, 409), (_down, ApiUnavailable, 503)):
        api._http.client = _mock(answer)
        with pytest.raises(kind) as e:
            api.heartbeat([], [])
        asked = (e.value.method, e.value.path, e.value.status)
        assert asked == ("POST", "/workers/heartbeat", status)
    api._http.client = _mock(_away)
    with pytest.raises(ApiUnreachable):
        list(api.blob("ab" * 32))


def test_ddpq_train_retries_on_unavailable_and_is_told_a_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ddpq.http import Http
    from ddpq.train import _Sender

    sender = _Sender.__new__(_Sender)  # no thread: only its request is under test
    sender._job_id = "5"
    sender._http = Http(URL, "t" * 30)  # the one HTTP core, its transport mocked
    for answer in (_down, _away):
        sender._http.client = _mock(answer)
        with pytest.raises(ApiUnavailable, match="/jobs/5/metrics"):
            sender._post("metrics", {"items": []})
    sender._http.client = _mock(_refuse)
    assert sender._post("metrics", {"items": []}) == 409
    assert "POST /jobs/5/metrics: HTTP 409: /jobs/5/metrics says no" in caplog.text


# ---- the CLI's exit codes ----------------------------------------------------------------


def test_the_documented_exit_codes_stand() -> None:
    assert sorted(base.EXIT_CODES) == [0, 1, 2, 3, 4, 5, 130]


@pytest.mark.parametrize("cls", [c for c in ERRORS if issubclass(c, DdpqError)])
def test_every_error_has_its_exit_code(cls: type[DdpqError]) -> None:
    if cls is DdpqError:
        return
    assert any(issubclass(cls, kind) for kind, _ in base.EXIT_FOR_ERROR), cls


def _api(cls: type[ApiError], status: int | None) -> ApiError:
    return cls("GET", f"{URL}/jobs", status, "why")


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (_api(ApiUnreachable, None), base.EXIT_UNREACHABLE),
        (_api(ApiUnavailable, 503), base.EXIT_API),
        (_api(ApiRefused, 404), base.EXIT_API),
        (_api(ApiBadAnswer, 200), base.EXIT_API),
        (SnapshotError("'a/../b' climbs out"), base.EXIT_API),
        (ConfigError('no server "lab"'), base.EXIT_USAGE),
        (CodeError("over the limit"), base.EXIT_USAGE),
        (errors.DataDirBusy("in use"), base.EXIT_USAGE),
        (errors.WallsError("no uids"), base.EXIT_USAGE),
        (errors.SlurmError("sinfo: no partition"), base.EXIT_USAGE),
        (errors.JobError("no recipe"), base.EXIT_USAGE),
        (errors.RequirementsRefused("a URL"), base.EXIT_USAGE),
        (WorkerError("else"), base.EXIT_USAGE),
    ],
)
def test_each_family_exits_with_its_code(error: DdpqError, code: int) -> None:
    assert base.exit_code(error) == code


def test_an_error_no_command_handled_is_one_line_naming_url_and_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = config.Target(URL, "t" * 30, "DDPQ_URL", "--token")
    monkeypatch.setattr(base._Api, "target", target)
    assert base.end(_api(ApiUnreachable, None)) == base.EXIT_UNREACHABLE
    line = capsys.readouterr().err.strip()
    assert line == (
        f"error: cannot reach the ddpq API at {URL} (URL from DDPQ_URL; token from --token): "
        "GET /jobs: why"
    )
    assert base.end(_api(ApiRefused, 404)) == base.EXIT_API
    assert capsys.readouterr().err.strip() == "error: GET /jobs: HTTP 404: why"
    assert base.end(_api(ApiRefused, 401)) == base.EXIT_API
    assert f"ddpq login {URL}" in capsys.readouterr().err
    assert base.end(ConfigError("no server")) == base.EXIT_USAGE
    assert capsys.readouterr().err.strip() == "error: no server"


def test_every_error_of_the_service_is_a_service_error() -> None:
    """The service's own tree (service/errors.py): its errors never mix with the
    client's, and each is one a route maps or the service's start-up names. One that
    FastAPI must see as its own kind (service.bodies' 413, an HTTPException) is of the
    tree too."""
    import service
    from service.errors import ServiceError

    found = set()
    for info in pkgutil.walk_packages(service.__path__, "service."):
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and issubclass(cls, Exception)
                and cls.__module__ == module.__name__
            ):
                found.add(cls)
    assert len(found) > 8, found
    outside = [f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, ServiceError)]
    assert outside == [], f"give these service.errors.ServiceError as base: {outside}"
