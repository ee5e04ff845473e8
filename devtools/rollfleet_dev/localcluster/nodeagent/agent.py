"""The agent: wires nodes, pod watches, pod workers, node stop/start and the service proxy.

One asyncio loop runs everything. Each node has a pod watch (`spec.nodeName=<node>`);
events update the node's view and start, update or finish `PodWorker`s. Talks to: the
kube-apiserver (through `kubeapi`) and, via the modules it wires, the pod processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rollfleet_dev.localcluster.nodeagent import control, ipam
from rollfleet_dev.localcluster.nodeagent.config import Pool, PoolsFile
from rollfleet_dev.localcluster.nodeagent.kubeapi import Api, ApiError, load_kubeconfig
from rollfleet_dev.localcluster.nodeagent.nodes import NodeKeeper
from rollfleet_dev.localcluster.nodeagent.pods import NodeInfo, PodWorker, Shared, grace_seconds
from rollfleet_dev.localcluster.nodeagent.processes import kill_leftovers
from rollfleet_dev.localcluster.nodeagent.serviceproxy import ServiceProxy, in_service_range

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# On shutdown (`rollfleet cluster down`) pods get at most this long to exit after SIGTERM.
SHUTDOWN_GRACE_S = 5.0
# A pod deleted without grace by someone else (`kubectl delete --force`): how long its processes get.
FORCED_GRACE_S = 2.0
CONTROL_POLL_S = 1.0


@dataclass
class NodeRuntime:
    keeper: NodeKeeper
    info: NodeInfo
    ips: ipam.PodIPs
    pods: dict[str, Obj] = field(default_factory=dict)
    workers: dict[str, PodWorker] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    finishing: set[str] = field(default_factory=set)
    stopped: bool = False


class Agent:
    def __init__(self, kubeconfig: Path, pools: PoolsFile, state_dir: Path) -> None:
        self.kubeconfig = load_kubeconfig(kubeconfig)
        self.pools = pools
        self.state_dir = state_dir
        self.pods_dir = state_dir / "pods"
        self.nodes: dict[str, NodeRuntime] = {}
        self._background: set[asyncio.Task[Any]] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run(self, stop: asyncio.Event) -> None:
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        killed = await kill_leftovers(self.pods_dir)
        if killed:
            log.info("stopped %d container(s) left by an earlier agent", killed)
        api = Api(self.kubeconfig)
        http = aiohttp.ClientSession()
        shared = Shared(api=api, config=self.pools, pods_dir=self.pods_dir, http=http)
        tasks: list[asyncio.Task[Any]] = []
        try:
            version = (await _retry_forever(lambda: api.get("/version")))["gitVersion"]
            index = 0
            for pool in self.pools.pools:
                for i in range(pool.nodes):
                    self._add_node(api, pool, f"{pool.name}-{i}", index, version)
                    index += 1
            stopped = control.stopped_nodes(self.state_dir)
            for node in self.nodes.values():
                await _retry_forever(node.keeper.register)
                node.stopped = node.info.name in stopped
                node.keeper.set_running(not node.stopped)
                tasks.append(asyncio.create_task(node.keeper.keep_alive()))
            synced: set[str] = set()
            for node in self.nodes.values():
                tasks.append(
                    asyncio.create_task(
                        api.informer(
                            "/api/v1/pods",
                            functools.partial(self._on_pod, shared, node),
                            on_synced=functools.partial(self._on_synced, node.info.name, synced),
                            fieldSelector=f"spec.nodeName={node.info.name}",
                        )
                    )
                )
            tasks.append(asyncio.create_task(self._control_loop(shared)))
            tasks.append(asyncio.create_task(self._maybe_proxy(api, self.kubeconfig.host_port)))
            log.info("node agent running: %s", ", ".join(f"{n.info.name} ({n.info.ip})" for n in self.nodes.values()))
            await stop.wait()
            log.info("shutting down: stopping every pod")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._stop_all_pods(SHUTDOWN_GRACE_S)
            await http.close()
            await api.close()

    def _add_node(self, api: Api, pool: Pool, name: str, index: int, version: str) -> None:
        ip = ipam.node_ip(index)
        keeper = NodeKeeper(api, pool, name, ip, version)
        self.nodes[name] = NodeRuntime(
            keeper=keeper, info=NodeInfo(name, ip, dict(pool.capacity)), ips=ipam.PodIPs(index)
        )

    async def _on_synced(self, node: str, synced: set[str]) -> None:
        """Once every node's pods are listed: drop the volumes of pods that no longer exist."""
        synced.add(node)
        if synced != set(self.nodes):
            return
        known = {uid for n in self.nodes.values() for uid in n.pods}
        for pod_dir in self.pods_dir.iterdir():
            if pod_dir.is_dir() and pod_dir.name.rsplit("_", 1)[-1] not in known:
                shutil.rmtree(pod_dir / "volumes", ignore_errors=True)
                shutil.rmtree(pod_dir / "work", ignore_errors=True)

    async def _on_pod(self, shared: Shared, node: NodeRuntime, kind: str, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            node.pods.pop(uid, None)
        else:
            node.pods[uid] = pod
        if not node.stopped:
            self._reconcile(shared, node, uid)

    def _reconcile(self, shared: Shared, node: NodeRuntime, uid: str) -> None:
        pod = node.pods.get(uid)
        worker = node.workers.get(uid)
        if pod is None:
            if worker is not None and uid not in node.finishing:
                self._spawn(self._finish(node, worker, grace_s=FORCED_GRACE_S, delete=False))
            return
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if worker is None:
            if deleting:
                if uid not in node.finishing:  # nothing runs (finished earlier, or the node was stopped)
                    node.finishing.add(uid)
                    self._spawn(self._force_delete(shared.api, node, pod))
                return
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return  # ran to completion before the agent (or the node) restarted
            worker = PodWorker(shared, node.info, node.ips, pod)
            node.workers[uid] = worker
            node.tasks[uid] = asyncio.create_task(self._run_worker(worker))
            return
        worker.update(pod)
        if deleting and uid not in node.finishing:
            self._spawn(self._finish(node, worker, grace_s=None, delete=True))

    async def _run_worker(self, worker: PodWorker) -> None:
        try:
            await worker.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: pod worker failed", worker.ref)

    async def _finish(
        self, node: NodeRuntime, worker: PodWorker, grace_s: float | None, delete: bool, mute: bool = False
    ) -> None:
        """Stop the pod's processes, then (if asked) force-delete it and free its resources."""
        node.finishing.add(worker.uid)
        try:
            if mute:
                worker.mute()
            await worker.terminate(grace_s)
            task = node.tasks.pop(worker.uid, None)
            if task is not None:
                try:
                    await asyncio.wait_for(task, 10)
                except TimeoutError:
                    log.warning("%s: worker did not finish; cancelled", worker.ref)
            if delete:
                await worker.report_final()
                await self._delete(node.keeper.api, worker.pod)
            worker.cleanup()
        finally:
            node.workers.pop(worker.uid, None)
            node.finishing.discard(worker.uid)

    async def _force_delete(self, api: Api, node: NodeRuntime, pod: Obj) -> None:
        try:
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                # Nothing of it runs here: it ended without a word (a node agent restart). Its finalizers'
                # controllers (a Job's pod tracking) wait for a terminal phase.
                meta = pod["metadata"]
                path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
                with contextlib.suppress(ApiError):
                    await api.strategic_patch(path, {"status": {"phase": "Failed", "reason": "Terminated"}})
            await self._delete(api, pod)
        finally:
            node.finishing.discard(pod["metadata"]["uid"])

    @staticmethod
    async def _delete(api: Api, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            await api.delete(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
            )
        except ApiError as e:
            if e.status not in (404, 409):  # gone already, or a new pod of the same name
                log.warning("%s/%s: force delete failed: %s", meta["namespace"], meta["name"], e)

    async def _control_loop(self, shared: Shared) -> None:
        """Apply `rollfleet cluster node stop|start` (control files) within a second."""
        while True:
            stopped = control.stopped_nodes(self.state_dir)
            for name, node in self.nodes.items():
                if (name in stopped) == node.stopped:
                    continue
                node.stopped = name in stopped
                node.keeper.set_running(not node.stopped)
                if node.stopped:
                    log.info("node %s stopped: heartbeats off, killing its pods", name)
                    for worker in list(node.workers.values()):
                        if worker.uid not in node.finishing:
                            self._spawn(self._finish(node, worker, grace_s=0, delete=False, mute=True))
                else:
                    log.info("node %s started again", name)
                    for uid in list(node.pods):
                        self._reconcile(shared, node, uid)
            await asyncio.sleep(CONTROL_POLL_S)

    async def _maybe_proxy(self, api: Api, api_address: tuple[str, int]) -> None:
        """Run the service proxy when Services get ClusterIPs of the local cluster's range (local to the host)."""
        svc = await _retry_forever(lambda: api.get("/api/v1/namespaces/default/services/kubernetes"))
        ip = svc.get("spec", {}).get("clusterIP", "")
        if not in_service_range(ip):
            log.info("service proxy off: the kubernetes Service's clusterIP %s is not in the local cluster's range", ip)
            return
        await ServiceProxy(api, api_address).run()

    async def _stop_all_pods(self, grace_s: float) -> None:
        finishing = []
        for node in self.nodes.values():
            for worker in list(node.workers.values()):
                grace = min(grace_s, grace_seconds(worker.pod))
                finishing.append(self._finish(node, worker, grace_s=grace, delete=False, mute=True))
        await asyncio.gather(*finishing, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)


async def _retry_forever(action: Any) -> Any:
    """Until the API server answers (it may still be starting, or briefly overloaded)."""
    delay = 0.2
    while True:
        try:
            return await action()
        except (TimeoutError, ApiError, aiohttp.ClientError, OSError) as e:
            log.info("waiting for the API server: %s", e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5)


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
