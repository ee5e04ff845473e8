"""The engine's own routes under /rollfleet/v1: state, readiness, tracked requests, abort, staging, relay.

Access is decided by the middleware (state, ready and requests are open; abort and staging
need the control token), so the handlers only do their job.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from rollfleet_engine.abort import abort_requests
from rollfleet_engine.protocol import (
    ABORT_PATH,
    READY_PATH,
    RELAY_MANIFEST_HEADER,
    REQUESTS_PATH,
    STAGE_PATH,
    STAGE_RELAY_PATH,
    STAGE_WAIT_MAX_S,
    STATE_PATH,
    WEIGHTS_MANIFEST_PATH,
    AbortRequest,
    AbortResult,
    EngineState,
    RequestsView,
    StageStatus,
    TrackedRequest,
    WeightUpdateInfo,
)
from rollfleet_engine.rank_staging import GroupStager
from rollfleet_engine.runtime import Runtime
from rollfleet_engine.staging import RelayUnavailable, Stager
from rollfleet_engine.weights_server import content_range

router = APIRouter()


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.rollfleet
    return runtime


@router.get(STATE_PATH, response_model=EngineState)
async def state(request: Request) -> EngineState:
    rt = _runtime(request)
    paused = await rt.engine.is_paused()
    running, waiting = rt.tracker.counts()
    return EngineState(
        model=rt.model_name,
        weight_version=await rt.refresh_weight_version(),
        paused=paused,
        pause_mode=rt.pause_mode if paused else None,
        running=running,
        waiting=waiting,
        weight_backend=rt.weight_backend,
        weights_intact=rt.weights_intact,
        instance=rt.instance,
        inference_open=rt.policy.inference_token is None,
        weights_manifest_sha256=rt.weights_manifest_sha256,
    )


@router.get(READY_PATH)
async def ready(request: Request) -> dict[str, bool]:
    """Readiness: this app only serves once the model is loaded; the engine must also be alive."""
    try:
        await _runtime(request).engine.check_health()
    except Exception as err:
        raise HTTPException(status_code=503, detail=f"engine not healthy: {err}") from err
    return {"ready": True}


@router.get(REQUESTS_PATH, response_model=RequestsView)
async def requests_view(request: Request) -> RequestsView:
    return _runtime(request).tracker.view()


@router.get(REQUESTS_PATH + "/{request_id}", response_model=TrackedRequest)
async def request_view(request: Request, request_id: str) -> TrackedRequest:
    tracked = _runtime(request).tracker.get(request_id)
    if tracked is None:
        raise HTTPException(status_code=404, detail=f"unknown request id {request_id!r}")
    return tracked


@router.post(ABORT_PATH, response_model=AbortResult)
async def abort(request: Request, body: AbortRequest) -> AbortResult:
    rt = _runtime(request)
    results = await abort_requests(rt.tracker, rt.engine.abort, body.request_ids, body.timeout_s, body.attempt)
    return AbortResult(results=results)


@router.post(STAGE_PATH, response_model=StageStatus, status_code=202)
async def stage(request: Request, body: WeightUpdateInfo) -> StageStatus:
    """Download and verify these weights into the staging area while the engine serves (prefetch).

    The caller's own Authorization goes with the download: from another engine's relay (a control
    route, the same fleet token), and harmlessly to the sidecar's weights server."""
    stager = _stager(request)
    try:
        if isinstance(stager, GroupStager):  # every rank in its own pod (rank_staging)
            return await stager.start(body)
        return stager.start(body, request.headers.get("authorization"))
    except ValueError as err:
        raise HTTPException(status_code=400, detail=str(err)) from err


@router.get(STAGE_RELAY_PATH + WEIGHTS_MANIFEST_PATH)
async def relay_manifest(request: Request) -> Response:
    """The manifest of the set this engine stages, for the next engine of a relay chain."""
    stager = _stager(request)
    try:
        # Waits until the manifest of the set asked for has arrived.
        raw = await run_in_threadpool(stager.relay_manifest, request.headers.get(RELAY_MANIFEST_HEADER))
    except RelayUnavailable as err:
        raise HTTPException(status_code=409, detail=str(err)) from err
    return Response(raw, media_type="application/json")


@router.get(STAGE_RELAY_PATH + "/{path:path}")
async def relay_shard(request: Request, path: str) -> StreamingResponse:
    """A shard of the set this engine stages, or the bytes of it a Range asks for (a relay tree's half), as they
    arrive (the stream breaks if staging fails)."""
    stager = _stager(request)
    try:
        if isinstance(stager, GroupStager):
            raise RelayUnavailable("a group's ranks stage their parts in their own pods: nothing here to relay")
        asked = request.headers.get("range")
        pinned = request.headers.get(RELAY_MANIFEST_HEADER)
        shard, (begin, end), chunks = await run_in_threadpool(stager.relay_shard, "/" + path, asked, pinned)
    except RelayUnavailable as err:
        raise HTTPException(status_code=409, detail=str(err)) from err
    except ValueError as err:  # a Range past the shard
        raise HTTPException(status_code=416, detail=str(err)) from err
    headers = {"Content-Length": str(end - begin)}
    if asked is None:
        return StreamingResponse(chunks, media_type="application/octet-stream", headers=headers)
    headers["Content-Range"] = content_range(begin, end, shard.size)
    return StreamingResponse(chunks, status_code=206, media_type="application/octet-stream", headers=headers)


@router.get(STAGE_PATH, response_model=StageStatus)
async def stage_status(request: Request, wait: Annotated[float, Query(ge=0, le=STAGE_WAIT_MAX_S)] = 0) -> StageStatus:
    """The staging's status; with `wait`, once it has ended (or after `wait` seconds): no polling loop."""
    stager = _stager(request)
    if isinstance(stager, GroupStager):
        return await stager.status(wait)
    return await run_in_threadpool(stager.status, wait)


def _stager(request: Request) -> Stager | GroupStager:
    """The engine's staging area; 404 where it has none (the sync sidecar then has it pull in the pause)."""
    stager = _runtime(request).stager
    if stager is None:
        raise HTTPException(status_code=404, detail="this engine does not prefetch: it pulls each update in the pause")
    return stager
