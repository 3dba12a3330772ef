"""Code snapshots: what a client uploads with the user token, and what workers fetch.

The upload protocol (ddpq submit does it; the README's curl section shows it):
GET /code/limits; POST /code/missing with every digest of the manifest; the missing
ones in packs (GET /code/packs, then POST /code/packs: several contents a body, each
compressed with zstd where that pays, ddpq.pack) or one by one (PUT
/code/blobs/{digest}, uncompressed, as older clients do); POST /code/snapshots with
the manifest; then POST /jobs with ``"code": <snapshot id>``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from ddpq import pack
from ddpq.snapshot import Entry
from service import code
from service.auth import UserAuth, WorkerAuth
from service.deps import DB, SettingsDep
from service.errors import responses
from service.schemas import (
    CodeLimits,
    CodeSummary,
    MissingReply,
    MissingRequest,
    PackLimits,
    PackReply,
    SnapshotIn,
    SnapshotPublic,
)

router = APIRouter(prefix="/code", dependencies=[UserAuth], tags=["code"])
# The worker's way to the same snapshots and contents, with the worker token.
workers_router = APIRouter(prefix="/workers/code", dependencies=[WorkerAuth], tags=["workers"])

DigestPath = Annotated[
    str, Path(pattern=r"^[0-9a-f]{64}$", description="sha256 of the content, lower-case hex")
]
BLOB_HEADERS = {"Cache-Control": "private, max-age=31536000, immutable"}
NO_SNAPSHOT = {404: "no such snapshot (never created, or collected)"}
NO_BLOB = {404: "no such content (never uploaded, or collected)"}
BINARY = {"schema": {"type": "string", "format": "binary"}}
BLOB_ANSWER = {
    200: {
        "content": {"application/octet-stream": BINARY},
        "description": "the content; compressed (`Content-Encoding: zstd`) when it is stored "
        "so and the request's `Accept-Encoding` names zstd",
    },
    **responses(NO_BLOB),
}


@router.get("/limits", response_model=CodeLimits)
async def get_code_limits(settings: SettingsDep) -> CodeLimits:
    """What one snapshot may hold: files, bytes in all, bytes in one file."""
    lim = settings.code_limits()
    return CodeLimits(
        max_files=lim.max_files, max_bytes=lim.max_bytes, max_file_bytes=lim.max_file_bytes
    )


@router.post("/missing", response_model=MissingReply)
@workers_router.post("/missing", response_model=MissingReply, name="worker_find_missing")
async def find_missing_blobs(body: MissingRequest, db: DB) -> MissingReply:
    """Which of these contents the API lacks: upload only those."""
    return MissingReply(missing=await run_in_threadpool(code.missing, db, body.digests))


PUT_BLOB = {"requestBody": {"required": True, "content": {"application/octet-stream": BINARY}}}


# A worker sends a job's directory as it ended (service.outputs) the way a client sends
# code: the contents the API lacks, then the manifest.
@router.put("/blobs/{digest}", status_code=204, openapi_extra=PUT_BLOB)
@workers_router.put(
    "/blobs/{digest}", status_code=204, openapi_extra=PUT_BLOB, name="worker_put_blob"
)
async def put_blob(digest: DigestPath, request: Request, db: DB) -> Response:
    """Upload one file's content; the API checks its sha256 against the path's."""
    data = await request.body()  # at most DDPQ_CODE_MAX_FILE_BYTES (bodies.BodyLimit)
    await run_in_threadpool(code.put_blob, db, digest, data)
    return Response(status_code=204)


@router.get("/packs", response_model=PackLimits)
async def get_pack_limits(settings: SettingsDep) -> PackLimits:
    """How POST /code/packs takes contents: its largest body, the most bytes its
    contents hold uncompressed, the encodings it reads."""
    body, content = settings.pack_limits()
    return PackLimits(
        max_body_bytes=body, max_content_bytes=content, encodings=list(pack.ENCODINGS)
    )


POST_PACK = {
    "requestBody": {
        "required": True,
        "description": "frames, each `<digest> <encoding> <size> <length>\\n` and `length` "
        "bytes: the content, as is (`identity`) or one zstd frame (`zstd`); `digest` is the "
        "sha256 of the uncompressed content, `size` its bytes (ddpq.pack)",
        "content": {pack.MEDIA_TYPE: BINARY},
    }
}


# The 422 of any other route (FastAPI's HTTPValidationError), though this one has no
# parameter for FastAPI to add it for: service.code refuses a frame in the same shape.
BAD_PACK: dict[int | str, dict[str, Any]] = {
    422: {
        "description": "a frame that cannot be taken: `loc` names its field (`frames[3].size`)",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}
        },
    }
}


@router.post("/packs", response_model=PackReply, openapi_extra=POST_PACK, responses=BAD_PACK)
async def upload_pack(request: Request, db: DB, settings: SettingsDep) -> PackReply:
    """Upload several contents in one body, each compressed or not; each is checked
    against its digest after decompressing, and one bad frame refuses them all (422
    naming the frame's field: `frames[3].size`)."""
    data = await request.body()  # at most pack_limits' body (bodies.BodyLimit)
    _, content = settings.pack_limits()
    max_file = settings.code_max_file_bytes
    stored, known = await run_in_threadpool(code.put_pack, db, data, max_file, content)
    return PackReply(stored=stored, known=known)


@router.post("/snapshots", status_code=201, response_model=CodeSummary)
async def create_snapshot(body: SnapshotIn, db: DB, settings: SettingsDep) -> CodeSummary:
    """Store a manifest whose contents are uploaded; answer its id for POST /jobs."""
    entries = [Entry.of(e.model_dump(exclude_none=True)) for e in body.files]
    return await run_in_threadpool(code.create_snapshot, db, entries, settings.code_limits())


@workers_router.post("/snapshots", status_code=201, response_model=CodeSummary)
async def worker_create_snapshot(body: SnapshotIn, db: DB, settings: SettingsDep) -> CodeSummary:
    """Store a job's directory as its attempt ended (its code and what it wrote), for
    POST /workers/jobs/{id}/outputs."""
    entries = [Entry.of(e.model_dump(exclude_none=True)) for e in body.files]
    limits = settings.directory_limits()
    return await run_in_threadpool(code.create_snapshot, db, entries, limits)


# One handler under both tokens; the worker's route has a name (its operation id) of its own.
@router.get(
    "/snapshots/{snapshot_id}", response_model=SnapshotPublic, responses=responses(NO_SNAPSHOT)
)
@workers_router.get(
    "/snapshots/{snapshot_id}",
    response_model=SnapshotPublic,
    responses=responses(NO_SNAPSHOT),
    name="worker_get_snapshot",
)
async def get_snapshot(snapshot_id: DigestPath, db: DB) -> SnapshotPublic:
    """A snapshot's manifest: every path with its size, digest and mode."""
    return await run_in_threadpool(code.snapshot, db, snapshot_id)


@router.get("/blobs/{digest}", response_class=Response, responses=BLOB_ANSWER)
@workers_router.get(
    "/blobs/{digest}", response_class=Response, responses=BLOB_ANSWER, name="worker_get_blob"
)
async def get_blob(digest: DigestPath, request: Request, db: DB) -> Response:
    """One content, as uploaded; as stored (zstd) to an asker that takes zstd."""
    # HTTP's own negotiation, not a parameter of the route: httpx names zstd in
    # Accept-Encoding wherever zstandard is installed, and decodes the answer itself.
    accepted = request.headers.get("accept-encoding", "").split(",")
    zstd_ok = pack.ZSTD in [p.split(";")[0].strip() for p in accepted]
    data, encoding = await run_in_threadpool(code.blob, db, digest, zstd_ok)
    headers = {**BLOB_HEADERS, "Vary": "Accept-Encoding"}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    return Response(data, media_type="application/octet-stream", headers=headers)
