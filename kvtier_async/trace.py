"""Request traces in Mooncake's FAST'25 format, read and checked before anything runs.

One JSON object a line: `timestamp` (ms from the start), `input_length` and `output_length`
(tokens), `hash_ids` (one id per `TOKENS_PER_BLOCK` tokens of the prompt, the last block
possibly shorter; equal ids are the same reusable prefix block). A trace is hostile input:
every field is checked, with the line it came from, and a line or a trace too big to be one
is refused rather than read.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import KVTierError

__all__ = ["TOKENS_PER_BLOCK", "Request", "TraceError", "read_trace"]

#: Tokens per hash id in Mooncake's traces.
TOKENS_PER_BLOCK = 512
#: The longest line read; a real request's line is a few KiB.
MAX_LINE_BYTES = 4 << 20
#: The biggest trace file read (a day of a busy cluster's requests is far less).
MAX_TRACE_BYTES = 4 << 30


class TraceError(KVTierError, ValueError):
    """A trace that cannot be replayed: says the file and line."""


@dataclass(frozen=True)
class Request:
    """One request of a trace."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block: int) -> int:
        """Tokens of the prompt in block `block`: the last one counts its real length (a trace
        whose ids do not match its lengths counts what the length leaves, 0 to 512)."""
        return max(0, min(TOKENS_PER_BLOCK, self.input_length - TOKENS_PER_BLOCK * block))


def read_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[Request]:
    """The first `limit` requests of the trace at `path` (all if None), in file order; raises
    `TraceError` naming the line of the first bad one, before any request is returned."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never hangs it
    except OSError as exc:
        raise TraceError(f"{path}: cannot open the trace: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise TraceError(f"{path}: not a regular file")
        if info.st_size > MAX_TRACE_BYTES:
            raise TraceError(f"{path}: {info.st_size} bytes, more than a trace of {MAX_TRACE_BYTES}")
        requests: list[Request] = []
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if limit is not None and len(requests) >= limit:
                break
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{number}: a line of more than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            requests.append(_request(path, number, raw))
    if not requests:
        raise TraceError(f"{path}: no requests in the trace")
    return requests


def _request(path: Path, number: int, raw: bytes) -> Request:
    where = f"{path}:{number}"
    try:
        entry = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from None
    if not isinstance(entry, dict):
        raise TraceError(f"{where}: a request is a JSON object, got {type(entry).__name__}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in entry:
            raise TraceError(f"{where}: missing field {field!r}")
    timestamp = entry["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not 0 <= timestamp < 1e15:
        raise TraceError(f"{where}: timestamp must be milliseconds >= 0, got {timestamp!r}")
    lengths = {}
    for field in ("input_length", "output_length"):
        value = entry[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {field} must be an int >= 0, got {value!r}")
        lengths[field] = value
    hash_ids = entry["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 63 for h in hash_ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of ints >= 0")
    if len(set(hash_ids)) != len(hash_ids):  # a prefix's blocks are all different blocks
        raise TraceError(f"{where}: hash_ids repeat within the request")
    return Request(
        number, float(timestamp), lengths["input_length"], lengths["output_length"], tuple(hash_ids)
    )
