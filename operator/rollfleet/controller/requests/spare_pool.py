"""The operator's side of spare runners (`spares`): taking one for a request, and keeping one for the next.

Talks to kube-apiserver: the spares' Jobs and assignment ConfigMaps, the Role and RoleBinding a request grants
the spare it takes, the fleet (the owner of a new spare).
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from rollfleet.api.request import RolloutRequestSpec
from rollfleet.contract import SPARE_RUNNER_PREFIX
from rollfleet.controller.owner import FleetRef, RequestRef
from rollfleet.controller.requests import spares
from rollfleet.controller.requests.desired import runner_role, runner_role_binding
from rollfleet.kube import CONFIG_MAP, FLEET, JOB, PERSISTENT_VOLUME_CLAIM, Conflict, Kube, NotFound, Obj

log = logging.getLogger(__name__)

PULL_POLICY = "IfNotPresent"


class SparePool:
    def __init__(self, kube: Kube, image: str) -> None:
        self.kube, self.image = kube, image
        # One decision at a time per fleet and claim: two requests ending at once keep one spare, not two.
        self._locks: dict[tuple[str, str, str], asyncio.Lock] = {}

    def _lock(self, namespace: str, fleet: str, claim: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, fleet, claim), asyncio.Lock())

    async def take(self, ref: RequestRef, spec: RolloutRequestSpec, claim: str, jobs: list[Obj]) -> bool:
        """Give the request one of these spare Jobs (`untaken`) that waits, oldest first; False when none does."""
        waiting = [
            job["metadata"]["name"]
            for job in sorted(jobs, key=lambda j: j["metadata"].get("creationTimestamp") or "")
            if not spares.finished(job)
        ]
        if not waiting:
            return False
        async with self._lock(ref.namespace, spec.fleet, claim):
            # The request's Role is made beside the taking (it grants nothing until bound, and a runner of its own
            # needs it as well): the spare, which learns of its request as its ConfigMap is patched, waits for one
            # write less before it may read the request.
            role = asyncio.create_task(self.kube.create_kept(runner_role(ref, spec)))
            try:
                for name in waiting:
                    try:
                        await self.kube.json_patch(CONFIG_MAP, ref.namespace, name, spares.take(ref))
                    except (Conflict, NotFound):  # no longer waiting (taken, or expired); gone, or not made yet
                        continue
                    await role
                    await self.finish_taking(ref, spec, name, role_made=True)
                    log.info("RolloutRequest %s/%s: took the spare runner %s", ref.namespace, ref.name, name)
                    return True
            finally:
                await role
        return False

    async def untaken(self, namespace: str, fleet: str, claim: str) -> list[Obj]:
        """The spare Jobs of this fleet and claim that no request took."""
        return await self.kube.list(JOB, namespace, spares.untaken_selector(fleet, claim))

    async def finish_taking(
        self, ref: RequestRef, spec: RolloutRequestSpec, name: str, role_made: bool = False
    ) -> None:
        """After the spare's ConfigMap names the request: grant the spare the request's Role, then make the request
        the Job's owner, which labels the Job for the request and so marks the taking done. Also what an operator
        restarted before that does (each step may be done already)."""
        # In this order: a RoleBinding names a Role that must exist (the API server checks its rules).
        if not role_made:
            await self.kube.create_kept(runner_role(ref, spec))
        await self.kube.create_kept(runner_role_binding(ref, account=name))
        await self.kube.patch(JOB, ref.namespace, name, spares.taken_job_patch(ref))

    async def taken_by(self, ref: RequestRef) -> str | None:
        """The spare this request took (its ConfigMap names it), if any."""
        taken = await self.kube.list(CONFIG_MAP, ref.namespace, spares.taken_selector(ref))
        return str(taken[0]["metadata"]["name"]) if taken else None

    async def keep(self, namespace: str, fleet: str, claim: str) -> None:
        """Make sure a spare waits for the next request of this fleet and claim."""
        async with self._lock(namespace, fleet, claim):
            if any(not spares.finished(j) for j in await self.untaken(namespace, fleet, claim)):
                return
            try:
                owner = FleetRef.of(await self.kube.get(FLEET, namespace, fleet))
                await self.kube.get(PERSISTENT_VOLUME_CLAIM, namespace, claim)
            except NotFound:  # its pod could never start
                return
            name = SPARE_RUNNER_PREFIX + secrets.token_hex(5)
            job = await self.kube.create(spares.spare_job(name, owner, claim, self.image, PULL_POLICY))
            # Its pod waits for its account a moment (the Job controller retries); the rest is owned by the Job.
            for manifest in spares.spare_identity(job):
                await self.kube.create(manifest)
            log.info("fleet %s/%s: spare runner %s made for claim %s", namespace, fleet, name, claim)
