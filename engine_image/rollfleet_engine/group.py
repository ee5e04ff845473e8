"""One engine across pods: the vLLM flags that make a pod one rank of its engine's group.

The operator runs each multi-pod engine as a LeaderWorkerSet group and tells every pod the same three facts,
from LWS's environment: the leader's address, the pods in the group, and this pod's rank in it
(``serve --group-leader ADDR --group-pods N --pod-rank R``). This module turns them into vLLM's own multi-node
flags, so that what vLLM calls them is known in one place, next to the launcher that runs it:

- tensor or pipeline parallel ranks over pods (data parallel 1): vLLM's multiproc executor across nodes,
  ``--nnodes N --node-rank R --master-addr ADDR --master-port P``;
- data parallel over pods: each pod runs ``dataParallelSizeLocal`` engine cores, the leader's API server
  balances over all of them, ``--data-parallel-address ADDR --data-parallel-rpc-port P
  --data-parallel-start-rank R*local`` (docs/engine.md, "Engines across pods").

`wait_for_address` holds a rank until the leader's name resolves: LWS's headless Service publishes it only once
the leader pod has an address, and vLLM gives up at once on a name it cannot resolve. Pure but for that wait.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Sequence

from rollfleet_engine.rank_staging import WORKER_EXTENSION

# The group's rendezvous ports on the leader: torch.distributed's store (tensor/pipeline parallel across
# nodes) and the data parallel coordinator's RPC port. Fixed, so a NetworkPolicy can name them; the ranks
# also open ports vLLM picks at run time, which is why group members may reach each other on every port.
MASTER_PORT = 29500
DATA_PARALLEL_RPC_PORT = 29550
# Flags the group sets: given by hand as well, they would disagree with the group's.
# Every rank's workers answer the leader's staging (rank_staging): each stages its part in its own pod.
_RANK_STAGING = ("--worker-extension-cls", WORKER_EXTENSION)
GROUP_FLAGS = (
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--data-parallel-rank",
    "--worker-extension-cls",
)


def last_int(args: Sequence[str], names: Sequence[str], default: int) -> int:
    """The value of the last of these flags in vLLM arguments (argparse keeps the last), `--flag N` or `--flag=N`.
    Raises ValueError for a value that is not a whole number."""
    value = default
    for i, arg in enumerate(args):
        name, eq, raw = arg.partition("=")
        if name in names:
            raw = raw if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not raw.isdigit():
                raise ValueError(f"{name} takes a whole number, not {raw!r}")
            value = int(raw)
    return value


def group_args(vllm_args: Sequence[str], leader: str, pods: int, rank: int) -> list[str]:
    """vLLM's flags for pod `rank` of `pods` whose leader is at `leader`, added to the engine's own.
    Raises ValueError (its message says what to change) for a shape vLLM cannot split this way."""
    if pods < 2:
        raise ValueError(f"--group-pods {pods}: a group has at least 2 pods (one pod needs no group flags)")
    if not 0 <= rank < pods:
        raise ValueError(f"--pod-rank {rank} is not a rank of a group of {pods} pods (0 to {pods - 1})")
    given = sorted({a.partition("=")[0] for a in vllm_args} & set(GROUP_FLAGS))
    if given:
        raise ValueError(f"{', '.join(given)}: set from the group (--group-leader, --pod-rank), not by hand")
    dp = last_int(vllm_args, ("--data-parallel-size", "-dp"), 1)
    if dp > 1:
        local = last_int(vllm_args, ("--data-parallel-size-local", "-dpl"), dp // pods)
        if local * pods != dp:
            raise ValueError(
                f"data parallel {dp} over {pods} pods needs {dp // pods if dp % pods == 0 else 'a whole number of'} "
                f"ranks per pod, not --data-parallel-size-local {local}"
            )
        out = [*_RANK_STAGING, "--data-parallel-size-local", str(local), "--data-parallel-address", leader]
        out += ["--data-parallel-rpc-port", str(DATA_PARALLEL_RPC_PORT)]
        return out + (["--data-parallel-start-rank", str(rank * local)] if rank else [])
    ranks = last_int(vllm_args, ("--tensor-parallel-size", "-tp"), 1) * last_int(
        vllm_args, ("--pipeline-parallel-size", "-pp"), 1
    )
    if ranks % pods:
        raise ValueError(
            f"tensor x pipeline parallel {ranks} ranks do not divide among {pods} pods: each pod runs the same number"
        )
    return [
        *_RANK_STAGING,
        "--nnodes",
        str(pods),
        "--node-rank",
        str(rank),
        "--master-addr",
        leader,
        "--master-port",
        str(MASTER_PORT),
        "--distributed-executor-backend",
        "mp",
    ]


def wait_for_address(
    host: str,
    timeout_s: float,
    resolve: Callable[[str], object] = socket.gethostbyname,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once `host` resolves; SystemExit naming it after `timeout_s`. Says every 10 s that it waits."""
    start = last_said = clock()
    while True:
        try:
            resolve(host)
            return
        except OSError as err:
            now = clock()
            if now - start >= timeout_s:
                raise SystemExit(
                    f"rollfleet engine: the group's leader {host!r} did not resolve in {timeout_s:.0f}s ({err}); "
                    "is the leader pod running, and LWS's headless Service there?"
                ) from err
            if now - last_said >= 10:
                print(f"rollfleet engine: waiting for the group's leader {host!r} to resolve ({err})", file=sys.stderr)
                last_said = now
            sleep(0.5)
