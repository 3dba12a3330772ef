"""Several file contents in one request body, each compressed or not: a pack.

A first submit of a tree of 2,000 sources sent one request per file, uncompressed; a
pack carries many contents in one body (``POST /code/packs``), each compressed with
zstd where that pays. A content stays named by the sha256 of its *uncompressed* bytes,
so a resubmit's "which do you lack" is unchanged and the API can check every content
after decompressing it.

The format (sent as ``application/octet-stream``, which generated clients know), a
sequence of frames, each::

    <digest> <encoding> <size> <length>\\n<length bytes of payload>

``digest``: sha256 of the uncompressed content, 64 lower-case hex digits; ``encoding``:
``identity`` or ``zstd`` (one zstd frame); ``size``: the uncompressed bytes;
``length``: the payload's bytes on the wire. The header is ASCII, at most
HEADER_MAX bytes with its newline.

Nothing in a frame is trusted by the side that reads it (``read``): the declared size
is held to a cap before anything is decompressed, decompression stops one byte past the
declared size (a zstd bomb costs at most that), a payload that ends early, carries
bytes after its zstd frame or decompresses to another size or digest is refused, and
every problem names the field (``frames[3].size``) that is wrong.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ddpq.errors import CodeError

try:  # the light install may lack it: a client then sends contents uncompressed
    import zstandard
except ImportError:  # pragma: no cover - exercised where zstandard is absent
    zstandard = None  # type: ignore[assignment]

MEDIA_TYPE = "application/octet-stream"
IDENTITY, ZSTD = "identity", "zstd"
ENCODINGS = (IDENTITY, ZSTD)
HEADER_MAX = 160  # 64 + "identity" + two 20-digit numbers + spaces and newline, rounded up
LEVEL = 1  # ~300 MB/s a core here, 0.57 of text; level 3 shrinks to 0.48 at a third the speed
# A sample this long of a larger content is compressed first: a content whose sample
# does not shrink by SKIP_RATIO (a checkpoint, an image, an archive) is sent as it is.
SAMPLE = 128 * 1024
SKIP_RATIO = 0.9
# How a client fills packs: contents up to TARGET_BYTES uncompressed (a larger one goes
# alone), at most MAX_FRAMES of them. Packs of 4 MB keep a few requests in flight for
# a tree of 80 MB; the API takes packs up to CONTENT_BYTES (or its largest file) and
# HEADER_BYTES of frame headers beside (service.config.Settings.pack_limits).
TARGET_BYTES = 4 * 1024 * 1024
MAX_FRAMES = 2_000
CONTENT_BYTES = 8 * 1024 * 1024
HEADER_BYTES = MAX_FRAMES * HEADER_MAX
# The most memory a zstd frame may ask of a decompressor (its window): what LEVEL's
# window needs for any input, well below zstd's default cap (128 MiB) a bomb would use.
MAX_WINDOW = 8 * 1024 * 1024


class PackError(CodeError, ValueError):
    """A pack that cannot be read: ``field`` names what is wrong (``frames[2].size``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Frame:
    """One content of a pack as read and checked: its digest, uncompressed size, its
    bytes, and ``stored``: the zstd frame it came in, worth keeping compressed (None
    when it came uncompressed, or compressed no smaller)."""

    digest: str
    size: int
    data: bytes
    stored: bytes | None


def available() -> bool:
    return zstandard is not None


def compress(data: bytes) -> tuple[str, bytes]:
    """(encoding, payload) for ``data``: zstd unless it does not shrink (a sample first,
    for a large content, so an incompressible one costs only the sample)."""
    if zstandard is None or len(data) < 64:
        return IDENTITY, data
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    if len(data) > 4 * SAMPLE:
        sample = cctx.compress(data[:SAMPLE])
        if len(sample) > SKIP_RATIO * SAMPLE:
            return IDENTITY, data
    packed = cctx.compress(data)
    if len(packed) > SKIP_RATIO * len(data):
        return IDENTITY, data
    return ZSTD, packed


def frame(digest: str, encoding: str, size: int, payload: bytes) -> bytes:
    """One frame's header; the payload follows it in the body."""
    return f"{digest} {encoding} {size} {len(payload)}\n".encode("ascii")


def decompress(payload: bytes, size: int) -> bytes:
    """The content of a zstd ``payload`` declared ``size`` bytes: ValueError unless it
    is exactly one whole frame of exactly that size. Never allocates or produces more
    than ``size`` bytes, whatever the frame's own header says."""
    if zstandard is None:
        raise ValueError("this process cannot decompress zstd (zstandard is not installed)")
    if size == 0:  # zstd reads a max_output_size of 0 as "no limit"
        raise ValueError("an empty content goes as identity, not zstd")
    try:
        # zstd sizes its output by the frame's header when the header has a size, and
        # takes max_output_size only when it has none: a header must agree first.
        said = zstandard.frame_content_size(payload)
        if said not in (-1, size):
            raise ValueError(f"the zstd frame says {said} bytes, not the declared {size}")
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        out = dctx.decompress(payload, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not one whole zstd frame of at most {size} bytes: {exc}") from None
    if len(out) != size:
        raise ValueError(f"it decompresses to {len(out)} bytes, not the declared {size}")
    return out


def read(body: bytes, max_size: int, max_total: int) -> list[Frame]:
    """Every frame of ``body``, decompressed and checked against its digest. PackError
    names the first problem; nothing of a pack with a problem is returned. ``max_size``:
    the largest content; ``max_total``: the most uncompressed bytes in all."""
    frames: list[Frame] = []
    seen: set[str] = set()
    total = 0
    pos = 0
    i = -1
    while pos < len(body):
        i += 1
        name = f"frames[{i}]"
        end = body.find(b"\n", pos, pos + HEADER_MAX)
        if end < 0:
            raise PackError(name, f"no frame header (a line of at most {HEADER_MAX} bytes)")
        parts = body[pos:end].split(b" ")
        if len(parts) != 4:
            raise PackError(name, "a frame header is '<digest> <encoding> <size> <length>'")
        raw_digest, raw_encoding, raw_size, raw_length = parts
        digest = raw_digest.decode("ascii", "replace")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise PackError(f"{name}.digest", "not a sha256 in 64 lower-case hex digits")
        encoding = raw_encoding.decode("ascii", "replace")
        if encoding not in ENCODINGS:
            raise PackError(
                f"{name}.encoding",
                f"unknown encoding {encoding[:20]!r} (known: {', '.join(ENCODINGS)})",
            )
        size, length = _number(raw_size, f"{name}.size"), _number(raw_length, f"{name}.length")
        if size > max_size:
            raise PackError(f"{name}.size", f"{size} bytes is over the largest file, {max_size}")
        total += size
        if total > max_total:
            raise PackError(
                f"{name}.size", f"the pack holds more than {max_total} bytes uncompressed"
            )
        start = end + 1
        if start + length > len(body):
            raise PackError(
                f"{name}.length", f"{length} bytes declared, {len(body) - start} left in the body"
            )
        payload = body[start : start + length]
        pos = start + length
        if encoding == IDENTITY:
            if length != size:
                raise PackError(f"{name}.size", f"identity: size {size} is not length {length}")
            data, stored = payload, None
        else:
            try:
                data = decompress(payload, size)
            except ValueError as exc:
                raise PackError(f"{name}.size", str(exc)) from None
            stored = payload if length < size else None  # kept compressed where it is smaller
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise PackError(
                f"{name}.digest",
                f"the content's sha256 is {actual}, not {digest}: damaged or misnamed",
            )
        if digest not in seen:
            seen.add(digest)
            frames.append(Frame(digest, size, data, stored))
    if not frames:
        raise PackError("frames", "an empty pack")
    return frames


def _number(raw: bytes, field: str) -> int:
    if not raw.isdigit() or len(raw) > 19:
        raise PackError(field, "not a whole number of bytes")
    return int(raw)
