"""The results store on a PersistentVolumeClaim (a file it appends to), and the reader that serves it."""

from __future__ import annotations

import asyncio
import errno
import io
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rollfleet.api.request import PersistentVolumeClaimResults, RolloutRequest
from rollfleet.controller.owner import RequestRef
from rollfleet.controller.requests import reader
from rollfleet.controller.requests.plan import SampleResult
from rollfleet.controller.requests.results_volume import (
    FileStore,
    ResultsVolumeError,
    relative_path,
    volume_failure,
)
from rollfleet.errors import RollfleetError

CLAIM = PersistentVolumeClaimResults(claim_name="data", sub_path="rl/step-7")
UID = "0123456789abcdef"


def result(prompt: int, sample: int, text: str = "out") -> SampleResult:
    return SampleResult(
        prompt=prompt, sample=sample, request_id=f"rr-{prompt}-{sample}", finish_reason="stop", text=text
    )


def test_the_file_is_named_by_request_and_uid_under_the_sub_path() -> None:
    assert relative_path(CLAIM, "rr", UID) == "rl/step-7/rr-01234567/samples.jsonl"
    assert relative_path(PersistentVolumeClaimResults(claim_name="data"), "rr", UID) == "rr-01234567/samples.jsonl"


def test_flushed_results_are_loaded_back_once_each(tmp_path: Path) -> None:
    store = FileStore(tmp_path, CLAIM, "rr", UID)
    assert asyncio.run(store.load()) == []
    assert store.add(result(0, 0)) and store.add(result(0, 1, "ü ☃"))
    assert not store.add(result(0, 0, "again"))  # one result per sample
    assert store.pending == 2 and store.ref("cmd").samples == 0
    asyncio.run(store.flush())
    ref = store.ref("cmd")
    assert (ref.persistent_volume_claim, ref.path, ref.samples) == ("data", "rl/step-7/rr-01234567/samples.jsonl", 2)
    assert ref.bytes == (tmp_path / ref.path).stat().st_size
    store.close()

    again = FileStore(tmp_path, CLAIM, "rr", UID)
    assert sorted(r.key for r in asyncio.run(again.load())) == [(0, 0), (0, 1)]
    again.close()
    # Memory keeps what counts a sample; its data is in the file only.
    assert again.results[(0, 1)] == result(0, 1).summary()
    stored = [SampleResult.from_line(line) for line in (tmp_path / ref.path).read_text().splitlines()]
    assert [r.text for r in stored] == ["out", "ü ☃"]


def test_a_torn_last_line_is_cut_off_and_the_next_write_starts_a_fresh_line(tmp_path: Path) -> None:
    path = tmp_path / relative_path(CLAIM, "rr", UID)
    path.parent.mkdir(parents=True)
    path.write_text(result(0, 0).line() + "\n" + result(0, 1).line()[:20])  # killed mid-write
    store = FileStore(tmp_path, CLAIM, "rr", UID)
    assert [r.key for r in asyncio.run(store.load())] == [(0, 0)]
    store.add(result(0, 1))
    asyncio.run(store.flush())
    store.close()
    assert [SampleResult.from_line(line).key for line in path.read_text().splitlines()] == [(0, 0), (0, 1)]


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    first = FileStore(tmp_path, CLAIM, "rr", UID)
    asyncio.run(first.load())
    with pytest.raises(RollfleetError, match="locked by another runner"):
        asyncio.run(FileStore(tmp_path, CLAIM, "rr", UID).load())
    first.close()
    asyncio.run(FileStore(tmp_path, CLAIM, "rr", UID).load())


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.EROFS, "ResultsVolumeReadOnly"),
        (errno.ENOSPC, "ResultsVolumeFull"),
        (errno.EDQUOT, "ResultsVolumeFull"),
        (errno.EACCES, "ResultsVolumeNotWritable"),
    ],
)
def test_a_volume_that_cannot_take_results_says_why(code: int, reason: str) -> None:
    failure = volume_failure(OSError(code, "boom"), "data")
    assert failure is not None and failure.reason == reason and "'data'" in failure.message


def test_other_io_errors_are_not_blamed_on_the_volume() -> None:
    assert volume_failure(OSError(errno.EIO, "io"), "data") is None


def test_a_failed_append_forgets_what_the_volume_did_not_take(tmp_path: Path) -> None:
    store = FileStore(tmp_path, CLAIM, "rr", UID)
    asyncio.run(store.load())
    store.add(result(0, 0))
    asyncio.run(store.flush())
    store.add(result(0, 1))

    def full(_: bytes) -> None:
        raise ResultsVolumeError(volume_failure(OSError(errno.ENOSPC, "full"), "data"))  # type: ignore[arg-type]

    store._append = full  # type: ignore[method-assign]
    with pytest.raises(ResultsVolumeError):
        asyncio.run(store.flush())
    assert list(store.results) == [(0, 0)] and store.pending == 0
    assert store.ref("cmd").bytes == store.bytes
    store.close()


def test_whole_lines_end_skips_a_torn_tail() -> None:
    assert reader.whole_lines_end(io.BytesIO(b'{"a":1}\n{"b"')) == 8
    assert reader.whole_lines_end(io.BytesIO(b'{"b"')) == 0
    assert reader.whole_lines_end(io.BytesIO(b"")) == 0


def request_body() -> dict[str, object]:
    return {
        "metadata": {"name": "rr", "namespace": "ns", "uid": UID},
        "spec": {
            "fleet": "f",
            "prompts": [{"text": "hi"}],
            "results": {"persistentVolumeClaim": {"claimName": "data", "subPath": "rl"}},
        },
    }


def test_the_reader_pod_mounts_the_claim_read_only_and_holds_only_the_tokens_digest() -> None:
    body = request_body()
    token, digest = reader.new_token()
    pod = reader.reader_pod(RolloutRequest.model_validate(body), RequestRef.of(body), "img", digest)
    spec = pod["spec"]
    assert spec["volumes"] == [{"name": "results", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}}]
    container = spec["containers"][0]
    assert container["volumeMounts"][0]["readOnly"] is True
    assert token not in str(pod) and digest in container["args"]
    assert container["args"][container["args"].index("--file") + 1].endswith("/rl/rr-01234567/samples.jsonl")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == UID


def test_the_reader_is_started_only_once_ready_and_says_why_it_cannot_be() -> None:
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Pending"}}
    assert not reader.check_started(pod)
    pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    assert reader.check_started(pod)
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": 'pvc "data" not found'}
        ],
    }
    with pytest.raises(reader.ReaderError, match=r'Unschedulable.*pvc "data" not found'):
        reader.check_started(pod)


def test_the_results_server_serves_whole_lines_to_the_tokens_holder_only(tmp_path: Path) -> None:
    file = tmp_path / "samples.jsonl"
    file.write_bytes(b'{"a":1}\n{"b":2}\n{"c"')
    token, digest = reader.new_token()
    port = _free_port()
    threading.Thread(target=reader.serve, args=(str(file), digest, "127.0.0.1", port), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    _wait_serving(url + "/healthz")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + reader.FILE_PATH, timeout=5)
    assert refused.value.code == 403
    asked = urllib.request.Request(url + reader.FILE_PATH, headers={reader.TOKEN_HEADER: token})
    with urllib.request.urlopen(asked, timeout=5) as resp:
        assert resp.read() == b'{"a":1}\n{"b":2}\n'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_serving(url: str) -> None:
    for _ in range(100):
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            threading.Event().wait(0.05)  # the server thread binds its port
    raise AssertionError(f"{url} never answered")


def test_results_added_while_a_flush_writes_wait_for_the_next_one(tmp_path: Path) -> None:
    # The runner flushes in the background and records results meanwhile: none may be counted stored early.
    store = FileStore(tmp_path, CLAIM, "rr", UID)
    asyncio.run(store.load())
    store.add(result(0, 0))
    writing, release = threading.Event(), threading.Event()
    append = store._append

    def slow(data: bytes) -> None:
        writing.set()
        release.wait(10)
        append(data)

    store._append = slow  # type: ignore[method-assign]

    async def scenario() -> None:
        flush = asyncio.create_task(store.flush())
        await asyncio.to_thread(writing.wait, 10)
        store.add(result(0, 1))
        assert store.pending == 2 and store.ref("cmd").samples == 0  # neither is on disk yet
        release.set()
        await flush
        assert store.pending == 1 and store.ref("cmd").samples == 1
        assert store.ref("cmd").bytes == (tmp_path / store.relative).stat().st_size
        await store.flush()

    asyncio.run(scenario())
    store.close()
    lines = (tmp_path / store.relative).read_text().splitlines()
    assert [SampleResult.from_line(line).key for line in lines] == [(0, 0), (0, 1)]
