"""The lifecycle of one pod bound to one of the agent's nodes.

A `PodWorker` prepares the pod (address and network namespace, /dev/shm, volumes), runs
init containers then the containers (restarts with back-off, probes), reports status
through `pods/status` when it changed, and on deletion stops every process and
force-deletes the pod.
Talks to: the kube-apiserver (ConfigMaps, Secrets, TokenRequests, pod status,
deletion) through `kubeapi`, and container processes through `processes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import json
import logging
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from rollfleet_dev.localcluster.nodeagent import env as envmod
from rollfleet_dev.localcluster.nodeagent import logs, podnet, probes, volumes
from rollfleet_dev.localcluster.nodeagent.config import PoolsFile
from rollfleet_dev.localcluster.nodeagent.ipam import FIRST_SERVICE_IP, PodIPs
from rollfleet_dev.localcluster.nodeagent.kubeapi import Api, ApiError
from rollfleet_dev.localcluster.nodeagent.processes import ContainerProcess, Exit, exec_in
from rollfleet_dev.localcluster.nodeagent.status import (
    ContainerObs,
    PodView,
    Running,
    Terminated,
    Waiting,
    backoff_delay,
    exit_reason,
    pod_status,
    should_restart,
)
from rollfleet_dev.localcluster.paths import cache_dir

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Paths that get a fresh tmpfs inside every container, so mounts below them (the
# ServiceAccount token) need no directory on the host and hide the host's own.
PRIVATE_ROOTS = ["/var/run/secrets"]
PREPARE_RETRY_CAP_S = 10.0
# Memory a pod's containers share, as kubelet gives them: its /dev/shm and its `medium: Memory`
# emptyDirs, in the host's tmpfs, one directory per pod.
SHM_ROOT = Path("/dev/shm/rollfleet-pods")
KUBERNETES_SERVICE_PORT = 443  # the `kubernetes` Service's; the agent's service proxy serves it


@dataclass(frozen=True)
class NodeInfo:
    name: str
    ip: str
    allocatable: dict[str, str]


@dataclass
class Shared:
    """What every pod worker of the agent uses."""

    api: Api
    config: PoolsFile
    pods_dir: Path
    http: aiohttp.ClientSession


def base_env(shared: Shared, hostname: str, image_env: dict[str, str]) -> dict[str, str]:
    """What every container's environment starts with, before the pod's own env."""
    env = {k: v for k, v in os.environ.items() if any(fnmatch.fnmatchcase(k, g) for g in shared.config.pass_env)}
    env.update(image_env)
    env.update(
        {
            # The project's Python environment first, so `python -m ...` and `rollfleet ...` work.
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOSTNAME": hostname,
            "KUBERNETES_SERVICE_HOST": FIRST_SERVICE_IP,
            "KUBERNETES_SERVICE_PORT": str(KUBERNETES_SERVICE_PORT),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(KUBERNETES_SERVICE_PORT),
            "KUBERNETES_PORT": f"tcp://{FIRST_SERVICE_IP}:{KUBERNETES_SERVICE_PORT}",
        }
    )
    return env


def hosts_file(pod: Obj, pod_ip: str) -> str:
    """The pod's /etc/hosts, as kubelet writes it: localhost, and the pod's hostname at its IP. Without
    it a process that looks its own hostname up (gloo, in every vLLM engine's start) asks DNS, which
    no pod reaches here, and waits out the resolver's timeouts."""
    spec = pod["spec"]
    hostname = spec.get("hostname") or pod["metadata"]["name"]
    fqdn = (
        f"{hostname}.{spec['subdomain']}.{pod['metadata']['namespace']}.svc.cluster.local"
        if spec.get("subdomain")
        else ""
    )
    lines = [
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod_ip}\t{fqdn}\t{hostname}".replace("\t\t", "\t"),
    ]
    return "# Kubernetes-managed hosts file (the local cluster's node agent).\n" + "\n".join(lines) + "\n"


def grace_seconds(pod: Obj) -> float:
    meta, spec = pod["metadata"], pod.get("spec", {})
    grace = meta.get("deletionGracePeriodSeconds")
    return float(grace if grace is not None else spec.get("terminationGracePeriodSeconds", 30))


class ContainerRun:
    """One container of the pod across its restarts."""

    def __init__(self, spec: Obj, obs: ContainerObs) -> None:
        self.spec = spec
        self.obs = obs
        self.proc: ContainerProcess | None = None
        self.env: dict[str, str] = {}
        self.cwd = ""
        self.kill_reason = ""  # set when the agent kills it (liveness, startup probe)


class PodWorker:
    def __init__(self, shared: Shared, node: NodeInfo, ips: PodIPs, pod: Obj) -> None:
        self.shared = shared
        self.node = node
        self.ips = ips
        self.pod = pod
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ref = f"{meta['namespace']}/{meta['name']}"
        self.dir = shared.pods_dir / logs.pod_dir_name(meta["namespace"], meta["name"], self.uid)
        self.shm = SHM_ROOT / self.uid
        self.host_network = bool(pod["spec"].get("hostNetwork"))
        self.terminating = asyncio.Event()
        self.pod_ip: str | None = None
        self.sandbox_ready = False
        self.start_time = datetime.now(UTC)
        self._dirty = asyncio.Event()
        self._muted = False
        self._last_sent: Obj | None = None
        self._volume_sources: dict[str, tuple[str, bool]] = {}
        self._refs = envmod.Refs()
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        previous = {
            c["name"]: c
            for c in (pod.get("status", {}).get("containerStatuses") or [])
            + (pod.get("status", {}).get("initContainerStatuses") or [])
        }
        init_wait = "PodInitializing" if spec.get("initContainers") else "ContainerCreating"
        self.init = [
            ContainerRun(c, self._adopt(c, previous.get(c["name"]), "PodInitializing"))
            for c in spec.get("initContainers") or []
        ]
        self.main = [ContainerRun(c, self._adopt(c, previous.get(c["name"]), init_wait)) for c in spec["containers"]]

    def _adopt(self, spec: Obj, previous: Obj | None, waiting: str) -> ContainerObs:
        """Container state when the agent (re)starts with a pod it may have run before: a container
        it had started counts as restarted (its processes were killed when the agent went away)."""
        obs = ContainerObs(name=spec["name"], image=spec.get("image", ""), state=Waiting(waiting))
        if not previous:
            return obs
        state = previous.get("state") or {}
        obs.restart_count = int(previous.get("restartCount", 0))
        if "terminated" in state:
            t = state["terminated"]
            obs.state = Terminated(
                int(t.get("exitCode", 0)),
                t.get("reason", ""),
                _ts(t.get("startedAt")),
                _ts(t.get("finishedAt")) or datetime.now(UTC),
                t.get("message", ""),
            )
        elif "running" in state:
            now = datetime.now(UTC)
            obs.last_state = Terminated(
                137, "Error", _ts(state["running"].get("startedAt")), now, "killed: the node agent restarted"
            )
            if self.restart_policy == "Never":
                obs.state = obs.last_state
            else:
                obs.restart_count += 1
        return obs

    # --- status -------------------------------------------------------------------------

    def publish(self) -> None:
        self._dirty.set()

    def mute(self) -> None:
        """Post no more status (the node is "lost", or the agent shuts down with the cluster)."""
        self._muted = True

    def compute_status(self) -> Obj:
        view = PodView(
            restart_policy=self.restart_policy,
            pod_ip=self.pod_ip,
            host_ip=self.node.ip,
            start_time=self.start_time,
            sandbox_ready=self.sandbox_ready,
            readiness_gates=tuple(g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []),
        )
        return pod_status(
            view,
            [c.obs for c in self.init],
            [c.obs for c in self.main],
            self.pod.get("status") or {},
            datetime.now(UTC),
        )

    async def status_loop(self) -> None:
        """Patch pods/status whenever the computed status differs from what was last sent."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                if not await self._send_status():
                    return
            except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("%s: status patch failed: %s", self.ref, e)
                await asyncio.sleep(1)
                self._dirty.set()

    async def report_final(self) -> None:
        """Send the status of the stopped pod (kubelet does before a deleted pod goes): controllers wait for
        its terminal phase, a Job for one to remove its pod-tracking finalizer and to make a replacement."""
        try:
            await self._send_status()
        except (ApiError, aiohttp.ClientError, OSError, TimeoutError) as e:
            log.warning("%s: final status not sent: %s", self.ref, e)

    async def _send_status(self) -> bool:
        """Patch pods/status if it changed; False when the pod is gone."""
        status = self.compute_status()
        if self._muted or status == self._last_sent:
            return True
        meta = self.pod["metadata"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        try:
            updated = await self.shared.api.strategic_patch(path, {"status": status})
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        self._last_sent = status
        self.pod = {**self.pod, "status": updated.get("status", status)}
        return True

    def update(self, pod: Obj) -> None:
        """A newer version of the pod from the watch."""
        self.pod = pod
        gates = self.pod["spec"].get("readinessGates")
        if gates:  # someone may have set a readiness gate condition: Ready may change
            self.publish()
        elif self._last_sent is not None and _overwritten(self._last_sent, pod.get("status")):
            # Someone else wrote them (the node lifecycle controller marks pods not ready when it cannot
            # read a node's lease, as after an API server restart): like kubelet's status manager, the
            # agent puts back what it observes.
            self._last_sent = None
            self.publish()

    # --- preparation ---------------------------------------------------------------------

    async def _fetch_refs(self) -> None:
        ns = self.pod["metadata"]["namespace"]
        cms, secrets = envmod.referenced_objects(self.pod)
        api = self.shared.api
        refs = envmod.Refs()
        for name in cms:
            refs.config_maps[name] = await api.get_or_none(f"/api/v1/namespaces/{ns}/configmaps/{name}")
        for name in secrets:
            refs.secrets[name] = await api.get_or_none(f"/api/v1/namespaces/{ns}/secrets/{name}")
        if self.pod["spec"].get("enableServiceLinks", True):
            refs.services = (await api.get(f"/api/v1/namespaces/{ns}/services")).get("items") or []
        self._refs = refs

    async def _tokens(self) -> dict[volumes.TokenKey, str]:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        out = {}
        for audience, seconds in volumes.token_requests(self.pod):
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [audience] if audience else [],
                    "expirationSeconds": seconds,
                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": self.uid},
                },
            }
            if not audience:
                del body["spec"]["audiences"]  # type: ignore[attr-defined]
            resp = await self.shared.api.create(
                f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", body
            )
            out[(audience, seconds)] = resp["status"]["token"]
        return out

    async def _claim_volume(self, vol: Obj) -> Obj:
        ns, api = self.pod["metadata"]["namespace"], self.shared.api
        claim = await api.get_or_none(
            f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{vol['persistentVolumeClaim']['claimName']}"
        )
        pv_name = ((claim or {}).get("spec") or {}).get("volumeName")
        pv = await api.get_or_none(f"/api/v1/persistentvolumes/{pv_name}") if pv_name else None
        return volumes.claim_volume(vol, claim, pv)

    async def render_volumes(self) -> None:
        """(Re)write every volume of the pod; API-backed ones with fresh contents and tokens."""
        await self._fetch_refs()
        tokens = await self._tokens()
        sources: dict[str, tuple[str, bool]] = {}
        host_path = functools.partial(self.shared.config.host_path, cache=cache_dir())
        for vol in self.pod["spec"].get("volumes") or []:
            memory = (vol.get("emptyDir") or {}).get("medium") == "Memory"
            vol_dir = (self.shm if memory else self.dir) / "volumes" / vol["name"]
            read_only = False
            if "persistentVolumeClaim" in vol:
                read_only = bool(vol["persistentVolumeClaim"].get("readOnly"))
                vol = await self._claim_volume(vol)
            host = volumes.prepare_host_volume(vol, vol_dir, host_path)
            if host is not None:
                sources[vol["name"]] = (host, read_only)
                continue
            files = volumes.volume_files(vol, self.pod, self._refs, tokens, self.node.allocatable)
            volumes.write_atomic(vol_dir, files or {})
            sources[vol["name"]] = (str(vol_dir), True)
        self._volume_sources = sources

    async def _retry(self, what: str, action: Callable[[], Awaitable[None]], on_error: Callable[[str], None]) -> bool:
        """Run `action` until it succeeds (True) or the pod is terminating (False)."""
        delay = 0.5
        while not self.terminating.is_set():
            try:
                await action()
                return True
            except (volumes.VolumeError, envmod.EnvError, ApiError, OSError, aiohttp.ClientError, TimeoutError) as e:
                msg = str(e) if not isinstance(e, ApiError) else f"API error {e.status} during {what}"
                log.info("%s: %s: %s", self.ref, what, e)
                on_error(msg)
                self.publish()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.terminating.wait(), delay)
                delay = min(delay * 2, PREPARE_RETRY_CAP_S)
        return False

    async def _prepare(self) -> bool:
        meta = self.pod["metadata"]
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "pod.json").write_text(
            json.dumps(
                {
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": self.uid,
                    "containers": [c["name"] for c in self.pod["spec"]["containers"]],
                    "initContainers": [c["name"] for c in self.pod["spec"].get("initContainers") or []],
                    "defaultContainer": (meta.get("annotations") or {}).get("kubectl.kubernetes.io/default-container"),
                }
            )
        )
        old_ip = (self.pod.get("status") or {}).get("podIP")
        if self.host_network:
            self.pod_ip = self.node.ip
        elif old_ip and self.ips.claim(old_ip):
            self.pod_ip = old_ip
        else:
            self.pod_ip = self.ips.allocate()
        (self.shm / "dev-shm").mkdir(parents=True, exist_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "hosts").write_text(hosts_file(self.pod, self.pod_ip))

        def not_ready(what: str) -> Callable[[str], None]:
            def say(msg: str) -> None:
                for c in self.init + self.main:
                    if isinstance(c.obs.state, Waiting):
                        c.obs.state = Waiting("ContainerCreating", f"{what} not ready: {msg}")

            return say

        ok = await self._retry("volume setup", self.render_volumes, not_ready("volumes"))
        if ok and not self.host_network:
            network = functools.partial(podnet.pod_up, self.uid, self.pod_ip)
            ok = await self._retry("pod network", network, not_ready("pod network"))
        if ok:
            self.sandbox_ready = True
            for c in self.init + self.main:
                if isinstance(c.obs.state, Waiting) and c.obs.state.reason == "ContainerCreating":
                    c.obs.state = Waiting("PodInitializing" if self.init and c in self.main else "ContainerCreating")
            self.publish()
        return ok

    async def token_refresh_loop(self) -> None:
        """Re-render API-backed volumes at 80% of the shortest token lifetime, as kubelet does."""
        lifetimes = [seconds for _, seconds in volumes.token_requests(self.pod)]
        if not lifetimes:
            return
        while True:
            await asyncio.sleep(0.8 * min(lifetimes))
            await self._retry("token refresh", self.render_volumes, lambda _: None)

    # --- containers ----------------------------------------------------------------------

    def _launch_spec(self, c: ContainerRun) -> tuple[dict[str, object] | None, str]:
        """The launcher's spec for this container, or (None, why it cannot run)."""
        spec = c.spec
        meta = self.pod["metadata"]
        rule = self.shared.config.image_rule(spec.get("image", ""))
        if not spec.get("command") and rule is None:
            return None, (
                f"image {spec.get('image')!r} has no local entrypoint: give the container a `command`, "
                "or add an `images:` rule for it to the node agent's pools file (docs/local-cluster.md)"
            )
        hostname = self.pod["spec"].get("hostname") or meta["name"]
        base = base_env(self.shared, hostname, rule.env if rule else {}) | envmod.service_links(self._refs.services)
        c.env = envmod.container_env(self.pod_with_ips(), spec, self._refs, base, self.node.allocatable)
        argv = envmod.container_argv(spec, c.env, rule.entrypoint if rule else [], rule.cmd if rule else [])
        if not argv:
            return None, f"image {spec.get('image')!r}: the container has no command and the image rule none"
        c.cwd = spec.get("workingDir") or str(self.dir / "work")
        # The pod's /dev/shm first: a volume mounted there (an engine's memory emptyDir) goes over it.
        mounts = [volumes.Mount(str(self.shm / "dev-shm"), "/dev/shm", False)]
        if not self.host_network:
            mounts.append(volumes.Mount(str(self.dir / "hosts"), "/etc/hosts", False))
        mounts += volumes.mount_plan(spec, self._volume_sources)
        return {
            "argv": argv,
            "env": c.env,
            "cwd": c.cwd,
            "hostname": hostname,
            "netns": None if self.host_network else podnet.netns_path(self.uid),
            "private_roots": PRIVATE_ROOTS,
            "mounts": [m.__dict__ for m in mounts],
        }, ""

    def pod_with_ips(self) -> Obj:
        """The pod as the downward API should see it (our address, even before the status patch lands)."""
        status = dict(self.pod.get("status") or {})
        if self.pod_ip:
            status.update(podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
        status.update(hostIP=self.node.ip, hostIPs=[{"ip": self.node.ip}])
        return {**self.pod, "status": status}

    async def _start(self, c: ContainerRun) -> bool:
        """Start one run of the container; False if it cannot (state says why)."""
        try:
            await self._fetch_refs()
            launch, why = self._launch_spec(c)
        except (envmod.EnvError, volumes.VolumeError, ApiError, aiohttp.ClientError, TimeoutError) as e:
            c.obs.state = Waiting("CreateContainerConfigError", str(e))
            return False
        if launch is None:
            c.obs.state = Waiting("ImageNotRunnableLocally", why)
            return False
        name = c.spec["name"]
        log_file = self.dir / f"{name}.log"
        if log_file.exists() and log_file.stat().st_size and c.obs.restart_count:
            log_file.rename(self.dir / f"{name}.{c.obs.restart_count - 1}.log")
        started_at = datetime.now(UTC)
        c.kill_reason = ""
        c.proc = await ContainerProcess.start(
            launch, self.dir / f"{name}.spec.json", log_file, self.dir / f"{name}.pid"
        )
        error = await c.proc.started()
        if error:
            await c.proc.wait()
            c.proc = None
            c.obs.state = Terminated(128, "StartError", started_at, datetime.now(UTC), error)
            return True
        c.obs.state = Running(started_at)
        c.obs.container_id = f"rollfleet://{self.uid}/{name}/{c.obs.restart_count}"
        c.obs.started = "startupProbe" not in c.spec
        c.obs.ready = c.obs.started and "readinessProbe" not in c.spec
        return True

    async def _run_once(self, c: ContainerRun) -> Exit | None:
        """One run: start, probe, wait for the exit. None if it could not start."""
        if not await self._start(c):
            self.publish()
            return None
        self.publish()
        if c.proc is None:  # StartError: the state already says so
            assert isinstance(c.obs.state, Terminated)
            return Exit(c.obs.state.exit_code, None, c.obs.state.message)
        probe_task = asyncio.create_task(self._probe_all(c))
        try:
            exit_ = await c.proc.wait()
        finally:
            probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe_task
        started_at = c.obs.state.started_at if isinstance(c.obs.state, Running) else None
        reason = exit_reason(exit_.code)
        message = c.kill_reason
        if not message and exit_.code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = logs.log_tail(self.dir / f"{c.spec['name']}.log")
        c.obs.state = Terminated(exit_.code, reason, started_at, datetime.now(UTC), message, exit_.signal)
        c.obs.ready = False
        c.obs.started = False
        c.proc = None
        self.publish()
        return exit_

    async def _container_loop(self, c: ContainerRun, init: bool) -> bool:
        """Run a container under the pod's restart policy; for an init container, True once it succeeded."""
        policy = "OnFailure" if init and self.restart_policy == "Always" else self.restart_policy
        delay: float | None = None
        if isinstance(c.obs.state, Terminated) and not should_restart(policy, c.obs.state.exit_code):
            return c.obs.state.exit_code == 0  # finished before the agent restarted
        while not self.terminating.is_set():
            exit_ = await self._run_once(c)
            if self.terminating.is_set():
                return False
            if exit_ is None:  # could not even start: retry the configuration later
                delay = backoff_delay(delay, 0)
            else:
                if not should_restart(policy, exit_.code):
                    return exit_.code == 0
                assert isinstance(c.obs.state, Terminated)
                ran = (
                    (c.obs.state.finished_at - c.obs.state.started_at).total_seconds() if c.obs.state.started_at else 0
                )
                delay = backoff_delay(delay, ran)
                c.obs.last_state = c.obs.state
                c.obs.state = Waiting(
                    "CrashLoopBackOff",
                    f"back-off {delay:g}s restarting failed container="
                    f"{c.spec['name']} pod={self.pod['metadata']['name']}_"
                    f"{self.pod['metadata']['namespace']}({self.uid})",
                )
                self.publish()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.terminating.wait(), delay)
            if exit_ is not None:
                c.obs.restart_count += 1
        return False

    async def _probe_all(self, c: ContainerRun) -> None:
        spec = c.spec
        if "startupProbe" in spec:
            if not await self._probe_loop(c, "startup", spec["startupProbe"]):
                return
            c.obs.started = True
            c.obs.ready = "readinessProbe" not in spec
            self.publish()
        loops = [
            self._probe_loop(c, kind, spec[f"{kind}Probe"])
            for kind in ("readiness", "liveness")
            if f"{kind}Probe" in spec
        ]
        await asyncio.gather(*loops)

    async def _probe_loop(self, c: ContainerRun, kind: str, probe: Obj) -> bool:
        """Probe until the container stops; a startup probe returns True when it succeeded.
        Startup and liveness failures kill the container (its restart policy decides what next)."""
        timing = probes.ProbeTiming.of(probe)
        tracker = probes.Tracker(timing, initial=kind == "liveness")
        await asyncio.sleep(timing.initial_delay_s)

        async def exec_fn(argv: list[str], limit_s: float) -> int:
            assert c.proc is not None
            return await exec_in(c.proc.identity, argv, c.env, c.cwd, limit_s)

        while c.proc is not None:
            ok, msg = await probes.check(probe, c.spec, self.pod_ip or self.node.ip, self.shared.http, exec_fn)
            flipped = tracker.record(ok)
            if kind == "startup" and tracker.result:
                return True
            if kind == "readiness" and flipped:
                c.obs.ready = tracker.result
                self.publish()
            if kind in ("startup", "liveness") and tracker.failed_out:
                log.info("%s: container %s failed its %s probe: %s; killing it", self.ref, c.spec["name"], kind, msg)
                c.kill_reason = f"{kind} probe failed: {msg}"
                await self._stop(c, float(probe.get("terminationGracePeriodSeconds") or grace_seconds(self.pod)))
                return False
            await asyncio.sleep(timing.period_s)
        return False

    async def _stop(self, c: ContainerRun, grace_s: float) -> None:
        """SIGTERM the container's process group; SIGKILL everything of it after the grace period."""
        proc = c.proc
        if proc is None:
            return
        proc.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.exited.wait(), grace_s)
        if not proc.exited.is_set():
            proc.signal(signal.SIGKILL)

    # --- the whole pod ---------------------------------------------------------------------

    async def run(self) -> None:
        """Prepare, run init containers, then containers; keep reporting until the pod is terminated
        (a pod that ran to completion keeps its worker, so its last status goes out)."""
        status_task = asyncio.create_task(self.status_loop())
        refresh_task: asyncio.Task[None] | None = None
        try:
            self.publish()
            if await self._prepare():
                refresh_task = asyncio.create_task(self.token_refresh_loop())
                if await self._init_containers():
                    await asyncio.gather(*(self._container_loop(c, init=False) for c in self.main))
            await self.terminating.wait()
        finally:
            for task in (refresh_task, status_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _init_containers(self) -> bool:
        for c in self.init:
            if not await self._container_loop(c, init=True):
                return False
        return True

    async def terminate(self, grace_s: float | None = None) -> None:
        """Stop every container (SIGTERM, SIGKILL after the grace period) and wait until all exited."""
        self.terminating.set()
        grace = grace_seconds(self.pod) if grace_s is None else grace_s
        procs = [c.proc for c in self.init + self.main if c.proc is not None]
        await asyncio.gather(*(self._stop(c, grace) for c in self.init + self.main))
        with contextlib.suppress(TimeoutError):  # SIGKILLed: exits within moments
            await asyncio.wait_for(asyncio.gather(*(p.exited.wait() for p in procs)), 5)

    def cleanup(self) -> None:
        """Free the pod's address, network namespace, memory and volumes; its logs stay (see
        docs/local-cluster.md)."""
        if self.pod_ip and not self.host_network:
            podnet.run(podnet.pod_down_commands(self.uid), check=False)
            self.ips.release(self.pod_ip)
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)
        shutil.rmtree(self.dir / "work", ignore_errors=True)
        for leftover in self.dir.glob("*.pid"):
            leftover.unlink(missing_ok=True)


def _ts(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def _conditions(status: Obj | None) -> dict[str, str]:
    """A pod status's conditions as type -> status ("True"/"False")."""
    return {c["type"]: c["status"] for c in (status or {}).get("conditions") or []}


def _overwritten(sent: Obj, current: Obj | None) -> bool:
    """Whether a condition the agent sent now has another value (conditions others add are theirs)."""
    now = _conditions(current)
    return any(now.get(ctype, value) != value for ctype, value in _conditions(sent).items())
