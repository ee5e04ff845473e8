"""The gateway's HTTP server against h11, a strict HTTP/1.1 parser, on a corpus of malformed requests.

Each case's bytes go to the gateway's server (real socket) and to an h11 server connection. The
gateway may refuse more than h11, never less: every request it answers must be one that h11 reads
from the same bytes, with the same method, target, body and headers (so no request is smuggled,
and no trailer or folded line changes what a request says); whatever h11 refuses, the gateway
answers with an error status or a closed connection. After each case a new connection must still
be served. Two leniencies that RFC 9112 grants a recipient are listed in the corpus with the RFC's
words ("lenient"): for those the reference is h11's reading of the strict form ("as").

The hand-written cases live in http_corpus.jsonl (add more there); systematic variants of
Content-Length, Transfer-Encoding, header names and values, request lines and line endings are
generated below.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
import pytest
from tests.unit.gateway.http_answers import Answer, Misframed, parse_answers
from tests.unit.gateway.test_httpserver import run

from rollfleet.gateway.httpserver import MAX_HEAD_BYTES, HttpServer, Limits, Message, Receive, Send

CORPUS = Path(__file__).with_name("http_corpus.jsonl")
WAIT_S = 2.0  # for an answer or a close; a case that needs it is one the server keeps waiting on


@dataclass(frozen=True)
class Seen:
    """What a parser read of one request: the fields a smuggled or altered request would change."""

    method: str
    path: str
    query: str
    body: str
    request_id: str | None
    authorization: str | None


async def _echo(scope: Message, receive: Receive, send: Send) -> None:
    body = (await receive())["body"]
    headers = dict(scope["headers"])  # the last value of a repeated header, as the gateway's own lookups
    seen = {
        "method": scope["method"],
        "path": scope["path"],
        "query": scope["query_string"].decode("latin-1"),
        "body": body.decode("latin-1"),
        "request_id": (headers.get(b"x-request-id") or b"").decode("latin-1") or None,
        "authorization": (headers.get(b"authorization") or b"").decode("latin-1") or None,
    }
    out = json.dumps(seen).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


@dataclass
class H11Reading:
    seen: list[Seen] = field(default_factory=list)
    refused: str | None = None  # h11's error, if it refused the bytes


def h11_reads(data: bytes) -> H11Reading:
    """The requests an h11 server reads from `data`, answering each one, until it refuses, waits or stops."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    conn.receive_data(data)
    out = H11Reading()
    request: h11.Request | None = None
    body = b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return out  # waits for more, switches protocols (no more HTTP to read), or is done
            if isinstance(event, h11.Request):
                request, body = event, b""
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                out.seen.append(_seen_by_h11(request, body))
                conn.send(h11.Response(status_code=404, headers=[("content-length", "0")]))  # no protocol switch
                conn.send(h11.EndOfMessage())
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return out  # the connection closes after this answer
                conn.start_next_cycle()
    except h11.RemoteProtocolError as err:
        out.refused = str(err)
        return out


def _seen_by_h11(request: h11.Request, body: bytes) -> Seen:
    target = bytes(request.target)
    if target.startswith(b"/"):
        path, _, query = target.partition(b"?")
    else:
        parts = urlsplit(target.decode("latin-1"))
        path, query = (parts.path or "/").encode("latin-1"), parts.query.encode("latin-1")
    headers = {bytes(k): bytes(v) for k, v in request.headers}
    return Seen(
        method=bytes(request.method).decode("latin-1"),
        path=path.decode("utf-8", "surrogateescape"),
        query=query.decode("latin-1"),
        body=body.decode("latin-1"),
        request_id=headers[b"x-request-id"].decode("latin-1") if b"x-request-id" in headers else None,
        authorization=headers[b"authorization"].decode("latin-1") if b"authorization" in headers else None,
    )


async def _gateway_answers(port: int, data: bytes, expected: int) -> tuple[bytes, bool]:
    """Send `data`; what comes back, and whether the server closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    out = b""
    closed = False
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    closed = True
                    break
                out += chunk
                answers, partial = parse_answers(out)
                if expected and sum(a.status == 200 for a in answers) >= expected and not partial:
                    break
    except TimeoutError:
        pass
    writer.close()
    return out, closed


def _seen_by_gateway(answer: Answer) -> Seen:
    return Seen(**json.loads(answer.body))


# --- the corpus -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    expect: tuple[int, ...] | None = None  # the statuses the gateway must answer, in order (where fixed)
    reference: bytes | None = None  # what h11 reads instead, for a leniency RFC 9112 grants


def hand_written() -> list[Case]:
    cases = []
    for line in CORPUS.read_text().splitlines():
        if line.strip():
            raw: dict[str, Any] = json.loads(line)
            expect = tuple(raw["expect"]) if "expect" in raw else None
            reference = raw["as"].encode("latin-1") if "lenient" in raw else None
            cases.append(Case(raw["name"], raw["request"].encode("latin-1"), expect, reference))
    return cases


def generated() -> Iterator[Case]:
    head = "POST /g HTTP/1.1\r\nHost: h\r\n"
    for i, value in enumerate(
        [
            "3",
            "03",
            "+3",
            "-3",
            " 3",
            "3 ",
            "3,3",
            "3, 3",
            "3,4",
            "0x3",
            "3.0",
            "",
            "1e1",
            "99999999999999999999",
            "\u0663",
        ]
    ):
        yield Case(f"cl-{i}-{value!r}", f"{head}Content-Length: {value}\r\n\r\nabc".encode())
    chunked_body = "3\r\nabc\r\n0\r\n\r\n"
    for i, value in enumerate(
        [
            "chunked",
            "Chunked",
            "CHUNKED",
            "\tchunked",
            "chunked ",
            "identity",
            "identity, chunked",
            "chunked, identity",
            "gzip, chunked",
            "chunked,chunked",
            "x-chunked",
            "chunked;q=1",
            "",
            "chunked\u000b",
        ]
    ):
        yield Case(f"te-{i}-{value!r}", f"{head}Transfer-Encoding: {value}\r\n\r\n{chunked_body}".encode("latin-1"))
    for c in ' "(),/:;<=>?@[\\]{}\x7f\x00\x01\t':
        yield Case(f"name-char-{ord(c):#x}", f"GET /n HTTP/1.1\r\nHost: h\r\nX{c}Y: v\r\n\r\n".encode("latin-1"))
    for code in [0, 1, 8, 10, 11, 12, 13, 27, 31, 127]:
        yield Case(f"value-char-{code:#x}", f"GET /v HTTP/1.1\r\nHost: h\r\nX: a{chr(code)}b\r\n\r\n".encode("latin-1"))
    for version in ["HTTP/1.1", "HTTP/1.0", "HTTP/0.9", "HTTP/2.0", "HTTP/1.10", "HTTP/1", "HTTP/ 1.1", "HTTP/1.1 "]:
        yield Case(f"version-{version!r}", f"GET /r {version}\r\nHost: h\r\n\r\n".encode("latin-1"))
    good = "POST /e HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi"
    for i, ending in enumerate(["\n", "\r", "\n\r", "\r\r\n"]):
        yield Case(f"line-ending-{i}", good.replace("\r\n", ending).encode("latin-1"))


CASES = hand_written() + list(generated())


def test_the_corpus_is_large_and_its_names_unique() -> None:
    assert len(CASES) >= 100, len(CASES)
    assert len({c.name for c in CASES}) == len(CASES)


def test_the_gateway_is_never_looser_than_h11_and_serves_after_every_case() -> None:
    failures: list[str] = []

    async def main() -> None:
        server = HttpServer(_echo, {}, Limits(max_body_bytes=1024 * 1024))
        await server.start("127.0.0.1", 0)
        port = server.ports[0]
        try:
            for case in CASES:
                problem = await _check(port, case)
                if problem:
                    failures.append(f"{case.name}: {problem}")
        finally:
            await server.shutdown()

    run(main())
    assert not failures, "\n".join(failures)


async def _check(port: int, case: Case) -> str | None:
    reading = h11_reads(case.reference or case.data)
    try:
        raw, closed = await _gateway_answers(port, case.data, len(reading.seen) if not reading.refused else 0)
        answers, partial = parse_answers(raw)
    except Misframed as err:
        return f"the gateway's answer is not valid HTTP/1.1 ({err})"
    if partial:
        return f"an answer cut short: {partial[:200]!r}"
    served = [a for a in answers if a.status == 200]
    if any(a.status >= 400 for a in answers[:-1]):
        return f"answers after an error status: {[a.status for a in answers]}"
    gateway_seen = [_seen_by_gateway(a) for a in served]
    if gateway_seen != reading.seen[: len(gateway_seen)] or len(gateway_seen) > len(reading.seen):
        return f"the gateway read {gateway_seen}, h11 read {reading.seen} (refused: {reading.refused})"
    if reading.refused and not closed:
        return f"h11 refuses it ({reading.refused}); the gateway neither refused nor closed: {raw[:300]!r}"
    if case.expect is not None and tuple(a.status for a in answers) != case.expect:
        return f"answered {[a.status for a in answers]}, expected {list(case.expect)}"
    again, _ = await _gateway_answers(port, b"GET /again HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n", 1)
    if not again.startswith(b"HTTP/1.1 200 "):
        return f"the gateway no longer serves: {again[:200]!r}"
    return None


@pytest.mark.parametrize("data", [b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n", b"GET /a HTTP/1.1\r\n\r\n"])
def test_h11_reading_of_a_plain_request(data: bytes) -> None:
    """The reference itself: h11 reads a valid request and refuses HTTP/1.1 without Host."""
    reading = h11_reads(data)
    if b"Host" in data:
        assert reading.refused is None and [s.path for s in reading.seen] == ["/a"]
    else:
        assert reading.refused is not None and not reading.seen
