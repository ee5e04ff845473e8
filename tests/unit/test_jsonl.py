"""JSON Lines stay one record per line under every common line reader (issue: random text broke `results`)."""

from __future__ import annotations

import io
import json

from rollfleet import jsonl
from rollfleet.controller.requests import plan
from rollfleet.controller.requests.plan import SampleResult

# Every character some common reader treats as a line break (str.splitlines, io, bytes.splitlines).
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def readers(text: str) -> dict[str, list[str]]:
    return {
        "str.splitlines": text.splitlines(),
        "io readlines": io.StringIO(text, newline=None).readlines(),
        "bytes.splitlines": [b.decode() for b in text.encode().splitlines()],
        "split newline": [line for line in text.split("\n") if line],
    }


def test_a_record_holding_every_line_break_character_is_one_line_for_every_reader() -> None:
    records = [{"text": f"a{ch}b", "n": i} for i, ch in enumerate(BREAKS)] + [{"text": "é 漢字 🙂"}]
    text = "".join(jsonl.dumps(r) + "\n" for r in records)
    for name, split in readers(text).items():
        assert [json.loads(line) for line in split] == records, name
    assert "é 漢字 🙂" in text  # non-ASCII stays readable; only line breaks are escaped


def test_dumps_writes_the_standard_librarys_compact_text_but_for_exponents() -> None:
    """orjson writes the lines (for speed); they must read back the same and be the same text as json's."""
    result = SampleResult(
        prompt=3, sample=1, request_id="u-3-1", finish_reason="length", text=f"t5 {BREAKS} é 漢字 🙂\x00\"\\",
        token_ids=[5, 6, 70000], logprobs=[-0.25, -1.5e-7, 0.0], weight_version="v1", weight_versions=["v1"],
        started_at=1796104951.1234, finished_at=1796104951.5678,
    )  # fmt: skip
    records = [json.loads(result.line()), {1: "int key", "nested": {"a": [[], {}], "b": [True, False, None]}}]
    for record in records:
        theirs = jsonl.safe_line(json.dumps(record, separators=(",", ":"), ensure_ascii=False))
        ours = jsonl.dumps(record)
        assert json.loads(ours) == json.loads(theirs)
        assert ours == theirs.replace("e-07", "e-7")  # the one difference: the shortest exponent


def test_safe_line_leaves_json_meaning_unchanged_and_is_idempotent() -> None:
    raw = json.dumps({"t": "x\u2028y\x85z"}, ensure_ascii=False)
    assert len(raw.splitlines()) == 3  # what broke `rollfleet results` readers
    safe = jsonl.safe_line(raw)
    assert len(safe.splitlines()) == 1 and json.loads(safe) == json.loads(raw)
    assert jsonl.safe_line(safe) == safe


def test_result_lines_with_line_break_characters_survive_splitlines() -> None:
    results = [
        SampleResult(prompt=0, sample=i, request_id=f"u-0-{i}", finish_reason="length", text=f"<{ch}>", token_ids=[i])
        for i, ch in enumerate(BREAKS)
    ]
    out = "".join(r.line() + "\n" for r in results)
    assert [SampleResult.from_line(line) for line in out.splitlines()] == results


def test_prompts_jsonl_splits_at_newline_only() -> None:
    text = "".join(json.dumps({"text": f"p{ch}q"}, ensure_ascii=False) + "\n" for ch in "\x85\u2028\u2029")
    prompts = plan.prompts_from_jsonl(text + "\r\n", "cm/k")
    assert [p.text for p in prompts] == ["p\x85q", "p\u2028q", "p\u2029q"]
    assert jsonl.lines('{"a":1}\r\n\n {"b":2}') == ['{"a":1}\r', ' {"b":2}']


def test_iter_lines_splits_a_byte_stream_at_newline_only_across_chunk_boundaries() -> None:
    events = [f"data: {jsonl.dumps({'text': ch})}" for ch in BREAKS if ch not in "\n\r"] + ["data: [DONE]"]
    raw = "".join(e + "\r\n" if i % 2 else e + "\n" for i, e in enumerate(events)).encode()
    chunks = [raw[i : i + 3] for i in range(0, len(raw), 3)]  # boundaries inside UTF-8 sequences too
    assert list(jsonl.iter_lines(chunks)) == events
    assert list(jsonl.iter_lines([b"a\n", b"tail"])) == ["a", "tail"]
