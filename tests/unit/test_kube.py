"""rollfleet.kube: error mapping, the config loader's choice, and the watch's re-list on 410 Gone.

The API server is faked under the official client, at urllib3's PoolManager: every request
is answered by a script and recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes
import pytest
import urllib3

from rollfleet import kube as kube_mod
from rollfleet.errors import RollfleetError
from rollfleet.kube import FLEET, POD, ApiError, Changed, Conflict, Kube, Listed, NotFound, load_client

Answer = tuple[int, Any]  # status, and a JSON body (or bytes as they are)


class Body(io.BytesIO):
    """A response body that closes at its end, as a socket's does (urllib3 streams until then)."""

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if not data:
            self.close()
        return data


class FakeApiServer:
    """Stands in for the PoolManager of the client's REST layer."""

    def __init__(self, answer: Callable[[str, str, dict[str, list[str]]], Answer]) -> None:
        self.answer = answer
        self.requests: list[tuple[str, str, dict[str, list[str]], dict[str, str]]] = []
        self._lock = threading.Lock()  # watch streams are read from threads of their own

    def request(self, method: str, url: str, headers: dict[str, str] | None = None, **_: Any) -> urllib3.HTTPResponse:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        with self._lock:
            self.requests.append((method, parts.path, query, dict(headers or {})))
            status, body = self.answer(method, parts.path, query)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return urllib3.HTTPResponse(
            body=Body(data),
            status=status,
            reason="scripted",
            preload_content=False,
            headers={"Content-Type": "application/json"},
        )

    def clear(self) -> None:
        pass


def kube_with(server: FakeApiServer) -> Kube:
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host="https://kube.test"))
    client.rest_client.pool_manager = server
    return Kube(client)


def status(code: int, reason: str, message: str) -> Answer:
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def pod(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv}}


# --- 404 and 409 ----------------------------------------------------------------------
@pytest.mark.parametrize(("code", "error"), [(404, NotFound), (409, Conflict), (500, ApiError)])
def test_failure_statuses_map_to_errors(code: int, error: type[ApiError]) -> None:
    server = FakeApiServer(lambda *_: status(code, "Scripted", 'pods "e-0" says no'))
    kube = kube_with(server)
    try:
        with pytest.raises(error) as raised:
            asyncio.run(kube.get(POD, "ns", "e-0"))
    finally:
        kube.close()
    err = raised.value
    assert type(err) is error and isinstance(err, RollfleetError)
    assert err.status == code and 'pods "e-0" says no' in str(err)


def test_a_create_that_lost_the_race_is_a_conflict_and_a_read_of_nothing_not_found() -> None:
    def answer(method: str, path: str, _: dict[str, list[str]]) -> Answer:
        if method == "POST":
            return status(409, "AlreadyExists", 'pods "e-0" already exists')
        return status(404, "NotFound", 'rolloutfleets.rollfleet.dev "f" not found')

    kube = kube_with(FakeApiServer(answer))
    try:
        with pytest.raises(Conflict):
            asyncio.run(
                kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "e-0", "namespace": "ns"}})
            )
        with pytest.raises(NotFound):
            asyncio.run(kube.get(FLEET, "ns", "f"))
    finally:
        kube.close()


def test_create_kept_keeps_what_exists_and_raises_any_other_refusal() -> None:
    refusals = iter([status(409, "AlreadyExists", 'roles "r" already exists'), status(403, "Forbidden", "no")])
    kube = kube_with(FakeApiServer(lambda *_: next(refusals)))
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "r", "namespace": "ns"}}
    try:
        assert asyncio.run(kube.create_kept(role)) is None  # made by an earlier try: kept
        with pytest.raises(ApiError) as raised:
            asyncio.run(kube.create_kept(role))
        assert raised.value.status == 403
    finally:
        kube.close()


def test_a_status_patch_is_a_merge_patch_of_the_status_subresource() -> None:
    server = FakeApiServer(lambda *_: (200, {"metadata": {"name": "f"}}))
    kube = kube_with(server)
    try:
        asyncio.run(kube.patch(FLEET, "ns", "f", {"status": {"phase": "Ready"}}, status=True))
    finally:
        kube.close()
    method, path, _, headers = server.requests[0]
    assert (method, path) == ("PATCH", "/apis/rollfleet.dev/v1alpha1/namespaces/ns/rolloutfleets/f/status")
    assert headers["Content-Type"] == "application/merge-patch+json"


# --- the config loader ----------------------------------------------------------------
class Loaders:
    """The official client's two loaders, recording which ran; in-cluster works only `in_pod`."""

    def __init__(self, in_pod: bool) -> None:
        self.in_pod = in_pod
        self.calls: list[str] = []

    def incluster(self, client_configuration: kubernetes.client.Configuration) -> None:
        self.calls.append("in-cluster")
        if not self.in_pod:
            raise kubernetes.config.ConfigException("not in a pod")

    def kubeconfig(self, config_file: str | None = None, client_configuration: Any = None) -> None:
        self.calls.append(f"kubeconfig {config_file}")


@pytest.mark.parametrize(
    ("kubeconfig", "in_pod", "expected"),
    [
        ("/tmp/kc", True, ["kubeconfig /tmp/kc"]),  # an explicit kubeconfig wins, even in a pod
        (None, True, ["in-cluster"]),
        (None, False, ["in-cluster", "kubeconfig None"]),  # None: $KUBECONFIG, else ~/.kube/config
    ],
)
def test_the_loader_chooses_the_credentials(
    monkeypatch: pytest.MonkeyPatch, kubeconfig: str | None, in_pod: bool, expected: list[str]
) -> None:
    loaders = Loaders(in_pod)
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", loaders.incluster)
    monkeypatch.setattr(kubernetes.config, "load_kube_config", loaders.kubeconfig)
    load_client(kubeconfig).close()
    assert loaders.calls == expected


# --- the watch ------------------------------------------------------------------------
def events(*items: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(json.dumps({"type": t, "object": o}).encode() + b"\n" for t, o in items)


def collect(kube: Kube, count: int, since: str | None = None) -> list[Listed | Changed]:
    async def go() -> list[Listed | Changed]:
        seen: list[Listed | Changed] = []
        async with contextlib.aclosing(kube.watch(POD, "ns", "app=x", timeout_s=5, since=since)) as updates:
            async for update in updates:
                seen.append(update)
                if len(seen) == count:
                    break
        return seen

    try:
        return asyncio.run(asyncio.wait_for(go(), timeout=10))
    finally:
        kube.close()


def test_the_watch_resumes_where_it_stopped_and_re_lists_after_410_gone() -> None:
    lists = iter(
        [
            {"metadata": {"resourceVersion": "1"}, "items": [pod("a", "1")]},
            {"metadata": {"resourceVersion": "7"}, "items": [pod("c", "7")]},
        ]
    )
    streams = {
        "1": events(("ADDED", pod("b", "2")), ("BOOKMARK", {"metadata": {"resourceVersion": "3"}})),
        "3": events(("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"})),
        "7": events(("MODIFIED", pod("c", "8"))),
    }

    def answer(_: str, path: str, query: dict[str, list[str]]) -> Answer:
        assert path == "/api/v1/namespaces/ns/pods" and query["labelSelector"] == ["app=x"]
        if "watch" not in query:
            return 200, next(lists)
        return 200, streams.get(query["resourceVersion"][0], b"")

    server = FakeApiServer(answer)
    seen = collect(kube_with(server), 4)
    assert seen == [
        Listed([pod("a", "1")]),
        Changed("ADDED", pod("b", "2")),
        Listed([pod("c", "7")]),
        Changed("MODIFIED", pod("c", "8")),
    ]
    watched_from = [q["resourceVersion"][0] for _, _, q, _ in server.requests if "watch" in q]
    assert watched_from[:3] == ["1", "3", "7"]


def test_a_watch_since_a_version_read_lists_only_once_that_version_is_gone() -> None:
    lists = iter([{"metadata": {"resourceVersion": "9"}, "items": [pod("a", "9")]}])
    streams = {
        "5": events(("MODIFIED", pod("a", "6")), ("ERROR", {"kind": "Status", "code": 410, "reason": "Expired"})),
    }

    def answer(_: str, __: str, query: dict[str, list[str]]) -> Answer:
        if "watch" not in query:
            return 200, next(lists)
        return 200, streams.get(query["resourceVersion"][0], b"")

    server = FakeApiServer(answer)
    assert collect(kube_with(server), 2, since="5") == [Changed("MODIFIED", pod("a", "6")), Listed([pod("a", "9")])]
    assert ["watch" in q for _, _, q, _ in server.requests][:2] == [True, False]  # watched first, listed on 410


def test_the_watch_lists_again_after_a_backoff_when_the_api_server_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kube_mod, "BACKOFF_MIN_S", 0.01)
    answers = iter(
        [
            status(500, "InternalError", "etcd is away"),
            (200, {"metadata": {"resourceVersion": "4"}, "items": [pod("a", "4")]}),
        ]
    )

    def answer(_: str, __: str, query: dict[str, list[str]]) -> Answer:
        return (200, b"") if "watch" in query else next(answers)

    assert collect(kube_with(FakeApiServer(answer)), 1) == [Listed([pod("a", "4")])]
