"""A minimal TensorBoard event-file writer: scalars only, no dependency.

TensorBoard reads "event files": TFRecord framing (length, masked CRC32C of the
length, the record, masked CRC32C of the record) around serialised ``Event``
protocol buffers (tensorboard/compat/proto/event.proto and summary.proto). Scalars
need four messages of those two files, encoded here by hand; tests read the files
back with TensorBoard's own ``EventAccumulator``. Writing them ourselves keeps
TensorBoard, protobuf and grpcio out of every rank's environment.

Each process writes a file of its own into the run directory; TensorBoard merges
a directory's files in name order, so attempts of one job append to one run. Each
file starts with a ``SessionLog START`` event at the first step it reports: like
a restarted TensorFlow job, it tells TensorBoard to drop the earlier attempt's
points from that step on, so a step reported by two attempts shows once, from the
newer, as ddpq's own metrics do.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO

# ---- CRC32C (Castagnoli), as TFRecord frames need it ----------------------------------

_POLY = 0x82F63B78  # reversed 0x1EDC6F41
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the record, its masked CRC."""
    length = struct.pack("<Q", len(record))
    return length + _masked(length) + record + _masked(record)


# ---- protocol buffer encoding of Event, Summary, Summary.Value, SessionLog ----------------


def _varint(n: int) -> bytes:
    n &= 0xFFFFFFFFFFFFFFFF  # int64: negatives take ten bytes, two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): strings, bytes, nested messages."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, what: bytes) -> bytes:
    # Event: wall_time = 1 (double), step = 2 (int64), then one field of the "what" oneof.
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + what


def file_version_event(wall_time: float) -> bytes:
    return _event(wall_time, 0, _field(3, b"brain.Event:2"))  # file_version = 3


def session_start_event(wall_time: float, step: int) -> bytes:
    return _event(wall_time, step, _field(7, b"\x08\x01"))  # session_log = 7 {status: START}


_FLOAT32_MAX = 3.4028234663852886e38
_tags: dict[str, bytes] = {}  # a tag's encoded Value.tag field plus simple_value's key


def scalars_event(wall_time: float, step: int, values: dict[str, float]) -> bytes:
    """Event{summary = 5: Summary{value = 1: [Value{tag = 1, simple_value = 2 (float)}]}}."""
    parts = []
    for tag, value in values.items():
        head = _tags.get(tag)
        if head is None:
            head = _tags[tag] = _field(1, tag.encode()) + b"\x15"
        if abs(value) > _FLOAT32_MAX and value == value:  # finite, but no float32 holds it
            value = math.copysign(math.inf, value)
        parts.append(_field(1, head + struct.pack("<f", value)))
    return _event(wall_time, step, _field(5, b"".join(parts)))


class EventWriter:
    """Appends scalar events to a new event file in ``run_dir``, created on first use."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._file: BinaryIO | None = None

    def _open(self, step: int) -> BinaryIO:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # TensorBoard's own naming; the pid keeps two processes of one host apart.
        name = f"events.out.tfevents.{now:.6f}.{socket.gethostname()}.{os.getpid()}"
        f = open(self.run_dir / name, "ab")  # noqa: SIM115 - kept open across writes
        f.write(frame(file_version_event(now)) + frame(session_start_event(now, step)))
        return f

    def write(self, points: list[tuple[int, dict[str, float]]]) -> None:
        """Write (step, {tag: value}) points and flush, so TensorBoard sees them now."""
        if not points:
            return
        if self._file is None:
            self._file = self._open(points[0][0])
        now = time.time()
        self._file.write(b"".join(frame(scalars_event(now, s, v)) for s, v in points))
        self._file.flush()
