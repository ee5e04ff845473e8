"""Reading what an HTTP/1.1 server wrote back, strictly: the framing errors a client would trip on fail here."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class Answer:
    status: int
    body: bytes


class Misframed(Exception):
    """The server's output is not a sequence of well-framed HTTP/1.1 responses."""


def parse_answers(data: bytes) -> tuple[list[Answer], bytes]:
    """The complete responses in `data` and what is left of an incomplete last one. Strict: every
    answer on a kept connection must say where it ends (length or chunks), as a client needs."""
    answers: list[Answer] = []
    while data:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            break
        lines = data[:end].decode("latin-1").split("\r\n")
        status_line = re.fullmatch(r"HTTP/1\.1 (\d{3}) [^\r\n]*", lines[0])
        if status_line is None:
            raise Misframed(f"not a status line: {lines[0]!r}")
        headers: dict[str, list[str]] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
                raise Misframed(f"not a header line: {line!r}")
            headers.setdefault(name.lower(), []).append(value.strip())
        status, rest = int(status_line[1]), data[end + 4 :]
        if status < 200:
            data = rest
            continue
        if "content-length" in headers:
            size = int(headers["content-length"][0])
            if len(rest) < size:
                break
            body, data = rest[:size], rest[size:]
        elif headers.get("transfer-encoding") == ["chunked"]:
            chunks = _dechunk(rest)
            if chunks is None:
                break
            body, data = chunks
        elif headers.get("connection") == ["close"]:
            body, data = rest, b""
        else:
            raise Misframed(f"an answer with no length on a kept connection: {lines}")
        answers.append(Answer(status, body))
    return answers, data


def _dechunk(data: bytes) -> tuple[bytes, bytes] | None:
    """(body, what follows) of a chunked body, or None while it is incomplete."""
    body = b""
    while True:
        end = data.find(b"\r\n")
        if end < 0:
            return None
        if not re.fullmatch(rb"[0-9a-fA-F]+", data[:end]):
            raise Misframed(f"not a chunk size: {data[:end][:80]!r}")
        size = int(data[:end], 16)
        if len(data) < end + 2 + size + 2:
            return None
        if data[end + 2 + size : end + 4 + size] != b"\r\n":
            raise Misframed("a chunk longer than its size")
        if size == 0:
            return body, data[end + 4 :]
        body += data[end + 2 : end + 2 + size]
        data = data[end + 4 + size :]
