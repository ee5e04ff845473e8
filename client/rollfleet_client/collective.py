"""Collective pushes from the trainer process: vLLM's own trainer engine sends, the sync sidecar drives the fleet.

::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from rollfleet_client.collective import CollectivePusher

    with CollectivePusher(ModuleSource(model), backend="nccl") as pusher:  # "gloo": the CPU twin
        pusher.push("step-12")  # returns when the fleet serves step-12 (PushStatus)

For fleets whose ``spec.weightSync.backend`` is collective. The tensors go from this
process straight to the engines' workers through vLLM's trainer API
(``WeightTransferTrainerFactory.trainer_init`` and ``send_weights``): ``nccl`` is vLLM's
``NCCLTrainerWeightTransferEngine``, ``gloo`` the engine package's CPU twin (registered
with vLLM's plugins). The engine's ``VLLMWeightSyncClient`` is ``FleetWeightSync``: each of
its calls goes to the sidecar, which fans it out to the fleet's engines inside the
fleet's record, pause and commit.

The pusher forms the group (the rendezvous on this pod's IP; the world size from the
sidecar) and forms it again when the sidecar says the engines changed (``GroupStale``),
which is how an engine that restarted or failed a transfer catches up: it receives the
next push in full. Needs torch and vLLM here (and the engine package for ``gloo``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from typing import Any

from rollfleet_client.errors import GroupStale, PushFailed, SidecarError
from rollfleet_client.sync import SyncClient, check_version
from rollfleet_client.sync_protocol import (
    COLLECTIVE_FINISH_PATH,
    COLLECTIVE_INIT_PATH,
    COLLECTIVE_PATH,
    COLLECTIVE_START_PATH,
    COLLECTIVE_UPDATE_PATH,
    CollectiveFinish,
    CollectiveGroup,
    CollectiveInit,
    CollectiveStart,
    CollectiveUpdate,
    PushState,
    PushStatus,
)

# A rendezvous and a transfer may take minutes for a large model; the sidecar bounds them itself.
_CALL_TIMEOUT_S = 1800.0


class FleetWeightSync:
    """vLLM's ``VLLMWeightSyncClient`` (a structural protocol: these four methods) over the sync sidecar.

    vLLM's ``send_weights`` finishes without a version, so the version of the push under
    way is set on ``version`` first (``CollectivePusher.push`` does).
    """

    def __init__(self, sync: SyncClient, backend: str) -> None:
        self.sync, self.backend = sync, backend
        self.version: str | None = None
        self.started: PushStatus | None = None  # the push ``start`` recorded
        self.finished: PushStatus | None = None

    def group(self) -> CollectiveGroup:
        return CollectiveGroup.model_validate(self.sync.call("GET", COLLECTIVE_PATH).json())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post(COLLECTIVE_INIT_PATH, CollectiveInit(backend=self.backend, init_info=init_info).model_dump_json())

    def start_weight_update(self) -> None:
        if self.version is None:
            raise SidecarError("set the push's version before sending (CollectivePusher.push does)")
        resp = self._post(COLLECTIVE_START_PATH, CollectiveStart(version=self.version).model_dump_json())
        self.started = PushStatus.model_validate(resp.json())

    def update_weights(self, update_info: Any) -> None:
        self._post(COLLECTIVE_UPDATE_PATH, CollectiveUpdate(update_info=update_info).model_dump_json())

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version or self.version or ""
        resp = self._post(COLLECTIVE_FINISH_PATH, CollectiveFinish(weight_version=version).model_dump_json())
        self.finished = PushStatus.model_validate(resp.json())

    def _post(self, path: str, body: str) -> Any:
        return self.sync.call("POST", path, content=body, timeout=_CALL_TIMEOUT_S)


class CollectivePusher:
    def __init__(
        self,
        source: Any,
        backend: str = "nccl",
        sync: SyncClient | None = None,
        address: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        """``source``: vLLM's ``WeightSource`` (``ModuleSource(model)``); ``address``: where the engines reach
        this process (default: ``$POD_IP``, else 127.0.0.1)."""
        self.source, self.backend, self.timeout_s = source, backend, timeout_s
        self.address = address or os.environ.get("POD_IP") or "127.0.0.1"
        self.sync = sync or SyncClient()
        self.client = FleetWeightSync(self.sync, backend)
        self._engine: Any = None  # vLLM's TrainerWeightTransferEngine, once the group is formed

    def __enter__(self) -> CollectivePusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._leave()

    def push(self, version: str) -> PushStatus:
        """Send the source's tensors to every engine as ``version``; the final status once the fleet has it.

        Raises ``PushFailed`` when the fleet stayed on its previous version. A push that reaches
        only some engines returns DONE with the others in ``pending_sync``: they rejoin at the next push.
        """
        check_version(version)
        # What the sidecar says of this push only: a failure before start must not read the last push's.
        self.client.version, self.client.started, self.client.finished = version, None, None
        for attempt in range(2):
            if self._engine is None:
                self._form()
            try:
                self._engine.send_weights()
            except GroupStale:
                self._leave()
                if attempt:
                    raise
                continue
            except Exception as err:
                self._leave()  # the group is broken either way; the sidecar has ended the push
                return self._outcome(err)
            break
        status = self.client.finished
        assert status is not None
        if status.state is not PushState.DONE:
            raise PushFailed(status)
        return status

    def _form(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # registers the engine package's backends (gloo)
        if self.backend not in WeightTransferTrainerFactory._registry:
            raise SidecarError(f"no vLLM trainer engine {self.backend!r}; install the engine package for gloo")
        init_cls = WeightTransferTrainerFactory._registry[self.backend]().init_info_cls
        init_info = init_cls(
            master_address=self.address,
            master_port=_free_port(self.address),
            world_size=self.client.group().world_size,
            rank=0,
            **({"timeout_s": self.timeout_s} if "timeout_s" in init_cls.__dataclass_fields__ else {}),
        )
        self._engine = WeightTransferTrainerFactory.trainer_init(init_info, client=self.client, source=self.source)

    def _leave(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()

    def _outcome(self, err: Exception) -> PushStatus:
        """What became of a push whose transfer failed here: the sidecar's final word on it."""
        started = self.client.started
        if started is None:
            raise err
        return self.sync.wait(started.generation)  # raises PushFailed unless the fleet moved


def state_dict_source(state_dict: Mapping[str, Any]) -> Any:
    """vLLM's ``WeightSource`` over a state dict, in its order (vLLM's ``ModuleSource`` takes a module)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in state_dict.items()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(state_dict.items())

    return StateDictSource()


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
        return port
