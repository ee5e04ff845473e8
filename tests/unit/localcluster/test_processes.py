"""Container processes for real: private mounts, start errors, and nothing left behind.

Needs root (CAP_SYS_ADMIN) for mount namespaces, as the node agent does; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rollfleet_dev.localcluster.nodeagent import podnet
from rollfleet_dev.localcluster.nodeagent.processes import ContainerProcess, kill_leftovers, members

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")


def _spec(
    tmp_path: Path, argv: list[str], mounts: list[dict] | None = None, netns: str | None = None
) -> dict[str, object]:
    return {
        "argv": argv,
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": str(tmp_path / "work"),
        "hostname": "podname",
        "netns": netns,
        "private_roots": ["/var/run/secrets"],
        "mounts": mounts or [],
    }


async def _start(tmp_path: Path, spec: dict[str, object]) -> tuple[ContainerProcess, str]:
    proc = await ContainerProcess.start(spec, tmp_path / "c.spec.json", tmp_path / "c.log", tmp_path / "c.pid")
    return proc, await proc.started()


async def _until(check: Callable[[], bool], limit_s: float = 5) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)  # polling /proc: there is no event to wait on


def test_mounts_are_private_and_read_only(tmp_path: Path) -> None:
    src = tmp_path / "vol"
    src.mkdir()
    (src / "f").write_text("hello")
    target = "/var/run/secrets/rollfleet-test"
    script = f"cat {target}/f; echo; hostname; touch {target}/g 2>/dev/null || echo ro; pwd"

    async def main() -> int:
        proc, error = await _start(
            tmp_path, _spec(tmp_path, ["sh", "-c", script], [{"source": str(src), "target": target, "read_only": True}])
        )
        assert error == ""
        return (await proc.wait()).code

    assert asyncio.run(main()) == 0
    assert (tmp_path / "c.log").read_text() == f"hello\npodname\nro\n{tmp_path / 'work'}\n"
    assert not Path(target).exists()  # the tmpfs and the bind lived in the container's namespace only
    assert not (tmp_path / "c.spec.json").exists()  # it held the environment: deleted once read


def test_a_container_runs_in_its_pods_network_namespace_with_its_address(tmp_path: Path) -> None:
    uid = f"unit-{uuid.uuid4()}"
    podnet.run(podnet.pod_up_commands(uid, "198.18.255.254"))
    try:

        async def main() -> int:
            proc, error = await _start(
                tmp_path, _spec(tmp_path, ["ip", "-brief", "addr"], netns=podnet.netns_path(uid))
            )
            assert error == ""
            return (await proc.wait()).code

        assert asyncio.run(main()) == 0
    finally:
        podnet.run(podnet.pod_down_commands(uid), check=False)
    seen = {line.split()[0].split("@")[0]: line.split()[2:] for line in (tmp_path / "c.log").read_text().splitlines()}
    assert seen["lo"][0] == "127.0.0.1/8" and seen["eth0"][0] == "198.18.255.254/32" and set(seen) == {"lo", "eth0"}


def test_start_error_is_reported(tmp_path: Path) -> None:
    async def main() -> str:
        proc, error = await _start(tmp_path, _spec(tmp_path, ["no-such-command-xyz"]))
        await proc.wait()
        return error

    assert "executable file not found" in asyncio.run(main())


def test_stopping_kills_escaped_children(tmp_path: Path) -> None:
    async def main() -> None:
        proc, _ = await _start(tmp_path, _spec(tmp_path, ["sh", "-c", "trap '' TERM; setsid sleep 300 & sleep 300"]))
        ns = proc.identity.mntns
        await _until(lambda: len(members(ns)) == 3)
        proc.signal(signal.SIGKILL)
        exit_ = await proc.wait()
        assert exit_.signal == signal.SIGKILL and exit_.code == 137
        await _until(lambda: members(ns) == [])

    asyncio.run(main())


def test_leftovers_of_an_earlier_agent_are_killed(tmp_path: Path) -> None:
    pod_dir = tmp_path / "pods" / "ns_p_uid"
    pod_dir.mkdir(parents=True)

    async def main() -> None:
        proc = await ContainerProcess.start(
            _spec(tmp_path, ["sleep", "300"]), pod_dir / "c.spec.json", pod_dir / "c.log", pod_dir / "c.pid"
        )
        await proc.started()
        assert (pod_dir / "c.pid").exists()
        assert await kill_leftovers(tmp_path / "pods", grace_s=2) == 1
        assert (await proc.wait()).signal == signal.SIGTERM

    asyncio.run(main())


def test_a_namespace_number_the_kernel_gave_to_a_stranger_is_never_signalled(tmp_path: Path) -> None:
    """The kernel gives a freed namespace's number to the next namespace made on the host (a kind node's
    container, in CI: its processes were SIGKILLed by the local cluster's agent). Neither an exited
    container nor an earlier agent's record of one may signal what now holds that number."""
    pod_dir = tmp_path / "pods" / "ns_p_uid"
    pod_dir.mkdir(parents=True)

    async def main() -> tuple[int, int | None]:
        proc = await ContainerProcess.start(
            _spec(tmp_path, ["true"]), pod_dir / "c.spec.json", pod_dir / "c.log", pod_dir / "c.pid"
        )
        assert await proc.started() == ""
        ident = proc.identity
        assert (await proc.wait()).code == 0
        # A stranger's namespace, made after the container's went: on Linux it gets the same number.
        stranger = await asyncio.create_subprocess_exec("unshare", "-m", "sleep", "300", start_new_session=True)
        try:
            ours = os.readlink("/proc/self/ns/mnt")
            await _until(lambda: os.readlink(f"/proc/{stranger.pid}/ns/mnt") != ours)
            theirs = os.readlink(f"/proc/{stranger.pid}/ns/mnt")
            proc.signal(signal.SIGKILL)
            # An earlier agent's record naming a container whose first process is gone, and that number.
            (pod_dir / "c.pid").write_text(json.dumps({**ident.__dict__, "mntns": theirs}))
            killed = await kill_leftovers(tmp_path / "pods", grace_s=1)
            with contextlib.suppress(TimeoutError):  # a SIGKILL sent would end it well within the second
                await asyncio.wait_for(asyncio.shield(stranger.wait()), 1)
            return killed, stranger.returncode
        finally:
            if stranger.returncode is None:
                stranger.kill()
            await stranger.wait()

    assert asyncio.run(main()) == (0, None)
