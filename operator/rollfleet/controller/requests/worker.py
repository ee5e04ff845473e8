"""`rollfleet request-runner`: the process in a RolloutRequest's runner Job.

Runs one request to a terminal phase (`runner.Run`, on uvloop, as the gateway whose client it uses) and
exits 0. A spare runner (`--spare`, `spares`) first waits for the operator to give it a request, then does
the same. Any other end exits non-zero, and the Job starts another pod, which adopts what this one sent
(see `runner`).
A watch keeps a live view of the request, so a new abort annotation acts within a tick.
SIGTERM (the pod deleted or evicted) stops the run; when the request itself is gone, its
in-flight samples are aborted at the engines first.

Talks to kube-apiserver (its request, through `rollfleet.kube`; a spare, its assignment
ConfigMap); `runner` talks to the fleet's gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Mapping
from typing import Any

import httpx
import uvloop

from rollfleet.api.request import TERMINAL_PHASES
from rollfleet.controller.requests import runner, spares
from rollfleet.controller.requests.status import Verdict
from rollfleet.controller.tasks import LiveBody, Stop, backoff_s
from rollfleet.controller.tokens import FileTokens
from rollfleet.hotpath import settle_gc
from rollfleet.kube import (
    CONFIG_MAP,
    EVENT,
    FLEET,
    REQUEST,
    SERVICE,
    ApiError,
    Changed,
    Conflict,
    Kube,
    NotFound,
    load_client,
)

EXIT_STOPPED = 143  # as a process killed by SIGTERM: not done, the Job makes another pod
FORBIDDEN = 403
RBAC_WAIT_S = 30.0
# A spare's first look: its Role and binding are made a few tens of ms after it learns of its request. It asks every
# 5 ms that long (a refused read costs the API server little), then less and less often.
RBAC_POLL_S, RBAC_FAST_S = 0.005, 0.25
RETRIES = 5  # runs in this pod before it fails (backoff 2, 4, 8, 16 s between them)
SPARE_WAITING = "waiting for a request"  # what a spare logs once started, ready to be given one

log = logging.getLogger(__name__)


def main(
    namespace: str,
    name: str | None,
    uid: str | None,
    spare: str | None,
    token_file: str,
    kubeconfig: str | None,
    verbose: bool,
) -> int:
    """Run the request named (`name`, `uid`), or as the spare runner `spare`, the one it is given."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="[%(asctime)s] %(name)-20s [%(levelname)-8s] %(message)s",
    )
    if spare is not None:
        return uvloop.run(run_spare(namespace, spare, token_file, kubeconfig))
    assert name is not None and uid is not None
    return uvloop.run(run_request(namespace, name, uid, token_file, kubeconfig))


async def run_spare(namespace: str, spare: str, token_file: str, kubeconfig: str | None = None) -> int:
    """Wait for a request (`spares`), run it, and exit; exit 0 at once when none came in SPARE_IDLE_S. What the
    run needs is made while it waits: its clients, and the API classes it calls (each an import on first use)."""
    kube = Kube(load_client(kubeconfig))
    kube.preload(REQUEST, FLEET, SERVICE, CONFIG_MAP, EVENT)
    http = runner.gateway_client()
    try:
        given = await wait_for_assignment(kube, namespace, spare, spares.SPARE_IDLE_S)
        if given is None:
            log.info("spare runner %s: no request came; exiting", spare)
            return 0
        log.info("spare runner %s: running RolloutRequest %s/%s (uid %s)", spare, namespace, given.name, given.uid)
        return await _run_request(kube, http, namespace, given.name, given.uid, token_file, given.fleet)
    finally:
        await http.aclose()
        kube.close()


async def wait_for_assignment(kube: Kube, namespace: str, spare: str, idle_s: float) -> spares.Assignment | None:
    """The request the operator gives this spare (its ConfigMap), or None: the ConfigMap is gone, or no request
    came in `idle_s` and the spare marked itself expired (a compare-and-swap: a spare just taken runs)."""
    latest: dict[str, Mapping[str, Any] | None] = {}
    changed = asyncio.Event()

    async def follow() -> None:
        async for update in kube.watch(CONFIG_MAP, namespace, field_selector=f"metadata.name={spare}"):
            if isinstance(update, Changed):
                latest["now"] = None if update.type == "DELETED" else update.object
            else:
                latest["now"] = update.items[0] if update.items else None
            changed.set()

    follower = asyncio.create_task(follow())
    log.info("spare runner %s: %s", spare, SPARE_WAITING)
    try:
        deadline = time.monotonic() + idle_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - time.monotonic()))
            changed.clear()
            if "now" not in latest:  # not read yet (the watch retries): wait on
                deadline = max(deadline, time.monotonic() + 1.0)
                continue
            now = latest["now"]
            if now is None:
                return None
            given = spares.assignment(now)
            if given is not None:
                return given
            if time.monotonic() >= deadline:
                try:
                    await kube.json_patch(CONFIG_MAP, namespace, spare, spares.expire())
                    return None
                except Conflict:  # no longer waiting (taken, most likely; the watch brings it)
                    deadline = time.monotonic() + 1.0
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower


def _ours(obj: Mapping[str, Any] | None, uid: str) -> bool:
    return obj is not None and obj["metadata"].get("uid") == uid


async def run_request(namespace: str, name: str, uid: str, token_file: str, kubeconfig: str | None = None) -> int:
    kube = Kube(load_client(kubeconfig))
    http = runner.gateway_client()
    try:
        return await _run_request(kube, http, namespace, name, uid, token_file)
    finally:
        await http.aclose()
        kube.close()


async def _run_request(
    kube: Kube, http: httpx.AsyncClient, namespace: str, name: str, uid: str, token_file: str, fleet: str | None = None
) -> int:
    """Run the request; a spare names its `fleet`, which it may read before the request's Role is known to the API
    server: that read goes beside the first look at the request, and the run starts with it."""
    stop = Stop()
    tokens = FileTokens(token_file)
    early = asyncio.create_task(runner.read_fleet(kube, tokens, namespace, fleet)) if fleet else None
    try:
        first = await _first_look(kube, namespace, name)
    finally:
        view = await _read_early(early)
    if not _ours(first, uid):
        log.info("RolloutRequest %s/%s (uid %s) is gone: nothing to run", namespace, name, uid)
        return 0
    assert first is not None
    if (first.get("status") or {}).get("phase") in TERMINAL_PHASES:
        return 0
    if first["spec"]["fleet"] != fleet:
        view = None
    body = LiveBody(first)
    settle_gc()  # every sample's result stays in memory: the collector would pass over them again and again
    terminating: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak references

    def on_sigterm() -> None:
        terminating.add(asyncio.ensure_future(_on_sigterm(kube, namespace, name, uid, stop)))

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    follower = asyncio.create_task(
        _follow(kube, body, stop, namespace, name, uid, first["metadata"]["resourceVersion"])
    )
    try:
        verdict = await _run(kube, tokens, http, body, stop, view)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
    if verdict is not None and verdict.terminal:
        return 0
    return 0 if stop.deleted else EXIT_STOPPED


async def _read_early(read: asyncio.Task[runner.FleetView] | None) -> runner.FleetView | None:
    """The fleet as the spare read it, or None: it could not (an older operator's spare lacks the right), and the
    run reads it itself."""
    if read is None:
        return None
    try:
        return await read
    except ApiError as err:
        log.info("the fleet could not be read before the run: %s", err)
        return None


async def _first_look(kube: Kube, namespace: str, name: str) -> Mapping[str, Any] | None:
    """The request, or None when it is gone. Its Role is bound just before this pod's Job is made (a spare's, just
    after the spare was given the request); the API server's authorizer may not know it for a moment: 403 is tried
    again for RBAC_WAIT_S, every 5 ms at first (a spare learns of its request as the operator binds its Role)."""
    start = time.monotonic()
    deadline, fast_until, poll_s = start + RBAC_WAIT_S, start + RBAC_FAST_S, RBAC_POLL_S
    while True:
        try:
            return await kube.get(REQUEST, namespace, name)
        except NotFound:
            return None
        except ApiError as err:
            if err.status != FORBIDDEN or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(poll_s)  # polling the authorizer: no event tells when the Role is known
        if time.monotonic() >= fast_until:
            poll_s = min(poll_s * 2, 1.0)


async def _run(
    kube: Kube, tokens: FileTokens, http: httpx.AsyncClient, body: LiveBody, stop: Stop, fleet: runner.FleetView | None
) -> Verdict | None:
    """Run it (the first try with the `fleet` read before it, if any); a run that fails (an API hiccup outlasting its
    retries) is run again in this pod after a backoff, adopting what it sent, RETRIES times before the pod fails and
    its Job takes over."""
    failures = 0
    while not stop:
        try:
            return await runner.Run(kube, tokens, http, body, stop, fleet if failures == 0 else None).run()
        except Exception:
            failures += 1
            log.exception("the run failed (%d of %d tries)", failures, RETRIES)
            if failures >= RETRIES:
                raise
            await stop.wait(backoff_s(failures))
    return None


async def _follow(kube: Kube, body: LiveBody, stop: Stop, namespace: str, name: str, uid: str, since: str) -> None:
    """Keep `body` the request as the API server has it; a deleted (or replaced) request stops the run. The watch
    goes on from the first look (`since`, its resourceVersion): a list would read the request again (its inline
    prompts too) at the run's start."""
    async for update in kube.watch(REQUEST, namespace, field_selector=f"metadata.name={name}", since=since):
        if isinstance(update, Changed):
            obj = None if update.type == "DELETED" else update.object
        else:
            obj = update.items[0] if update.items else None
        if not _ours(obj, uid):
            stop.set(deleted=True)
            return
        assert obj is not None
        body.replace(obj)


async def _on_sigterm(kube: Kube, namespace: str, name: str, uid: str, stop: Stop) -> None:
    """The pod is going away. Gone with the request (the garbage collector deletes the runner with it,
    its Role included, hence 403 too): stop its samples. Otherwise another pod takes over."""
    try:
        deleted = not _ours(await kube.get(REQUEST, namespace, name), uid)
    except NotFound:
        deleted = True
    except ApiError as err:
        deleted = err.status == FORBIDDEN
    log.info("SIGTERM: %s", "the request is gone, stopping its samples" if deleted else "handing over to another pod")
    stop.set(deleted=deleted)
