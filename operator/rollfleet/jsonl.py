"""JSON Lines that every common line reader splits the same way: one record per physical line.

JSON writers that keep non-ASCII text (orjson; `json.dumps(..., ensure_ascii=False)`) escape
U+0000-U+001F but leave U+0085 (NEL), U+2028 and U+2029 raw, and Python's `str.splitlines()`
(and readers built on it) breaks lines at those too. Generated text holds them often enough (a
random-weight model emits them within a few hundred samples), so every JSONL this project writes
escapes them, and every JSONL or server-sent-event stream it reads splits at "\\n" only, as the
JSON Lines and SSE formats say.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

# Characters that some line readers treat as line breaks and JSON leaves raw. They can only
# occur inside JSON strings (they are not JSON whitespace), where the escape means the same.
_LINE_BREAKS_JSON_KEEPS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def safe_line(line: str) -> str:
    """A serialized JSON record with every line-break character escaped (already-safe text is unchanged)."""
    # A translate looks up every character (20 µs on a sample's line); these scans are a fraction of that.
    if line.isascii() or not any(chr(c) in line for c in _LINE_BREAKS_JSON_KEEPS):
        return line
    return line.translate(_LINE_BREAKS_JSON_KEEPS)


def dumps(record: Any) -> str:
    """One compact JSON record that is exactly one line under any splitter; non-ASCII text stays readable.

    orjson writes the text `json.dumps(record, separators=(",", ":"), ensure_ascii=False)` writes (but exponents:
    -1e-7 where json writes -1e-07, the same number) 8 times faster: a sample's results line in 7 µs against 57,
    which a request runner pays for every sample it records."""
    return safe_line(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS).decode())


def lines(text: str) -> list[str]:
    """The non-blank records of a JSONL text, split at "\\n" only (CRLF is fine: "\\r" is JSON whitespace)."""
    return [line for line in text.split("\n") if line.strip()]


def iter_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of a byte stream (an SSE response, a JSONL download) as they arrive, split at b"\\n" only.

    httpx's `iter_lines()` splits like `str.splitlines()`, so it cuts an SSE event whose generated
    text holds U+2028 and the like. Splitting bytes is safe: no UTF-8 sequence contains b"\\n".
    """
    pending = b""
    for data in chunks:
        *complete, pending = (pending + data).split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.decode()
