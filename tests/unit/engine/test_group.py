"""A pod's rank in a multi-pod engine becomes vLLM's own multi-node flags (rollfleet_engine.group), and the
launcher refuses a group it cannot form with a message that says what to change."""

from __future__ import annotations

import pytest

from rollfleet_engine.group import DATA_PARALLEL_RPC_PORT, MASTER_PORT, group_args, wait_for_address
from rollfleet_engine.rank_staging import WORKER_EXTENSION
from rollfleet_engine.server import parse_serve_argv

LEADER = "tiny-engine-0-0.tiny-engine-0.ns"


def test_tensor_parallel_over_pods_runs_vllms_multiproc_executor_across_nodes() -> None:
    for rank in (0, 1):
        args = group_args(["--tensor-parallel-size", "2"], LEADER, pods=2, rank=rank)
        assert args == [
            "--worker-extension-cls", WORKER_EXTENSION,
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", LEADER,
            "--master-port", str(MASTER_PORT), "--distributed-executor-backend", "mp",
        ]  # fmt: skip
    assert group_args(["-tp", "2", "-pp", "2"], LEADER, pods=4, rank=3)[2:6] == ["--nnodes", "4", "--node-rank", "3"]


def test_data_parallel_over_pods_gives_each_pod_its_engine_cores() -> None:
    leader = group_args(["--data-parallel-size", "4"], LEADER, pods=2, rank=0)
    assert leader == [
        "--worker-extension-cls", WORKER_EXTENSION,
        "--data-parallel-size-local", "2", "--data-parallel-address", LEADER,
        "--data-parallel-rpc-port", str(DATA_PARALLEL_RPC_PORT),
    ]  # fmt: skip
    # The second pod's cores are ranks 2 and 3.
    assert group_args(["--data-parallel-size=4"], LEADER, pods=2, rank=1)[-2:] == ["--data-parallel-start-rank", "2"]


@pytest.mark.parametrize(
    ("args", "pods", "rank", "message"),
    [
        (["-tp", "3"], 2, 0, "do not divide among 2 pods"),
        (["-dp", "4", "--data-parallel-size-local", "1"], 2, 1, "needs 2 ranks per pod"),
        (["-tp", "2"], 2, 2, "--pod-rank 2 is not a rank of a group of 2 pods"),
        (["-tp", "2"], 1, 0, "at least 2 pods"),
        (["-tp", "2", "--node-rank", "1"], 2, 1, "--node-rank: set from the group"),
        (["-tp", "2", "--worker-extension-cls", "x.Y"], 2, 0, "--worker-extension-cls: set from the group"),
        (["-tp", "two"], 2, 0, "takes a whole number"),
    ],
)
def test_a_group_vllm_cannot_form_is_refused_with_the_reason(
    args: list[str], pods: int, rank: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        group_args(args, LEADER, pods, rank)


def test_the_launcher_adds_the_group_flags_and_checks_the_leader_serves() -> None:
    group = ["--group-leader", LEADER, "--group-pods", "2"]
    leader = parse_serve_argv(["--model", "/m", "--token-file", "/t", *group, "--pod-rank", "0", "--", "-tp", "2"])
    assert leader.group_leader == LEADER and leader.vllm_args[:2] == ["-tp", "2"]
    assert "--node-rank" in leader.vllm_args and not leader.headless
    rank = parse_serve_argv(["--model", "/m", "--headless", *group, "--pod-rank", "1", "--", "-tp", "2"])
    assert rank.vllm_args[rank.vllm_args.index("--node-rank") + 1] == "1"
    with pytest.raises(SystemExit, match="--pod-rank 1 needs --headless"):
        parse_serve_argv(["--model", "/m", "--token-file", "/t", *group, "--pod-rank", "1", "--", "-tp", "2"])
    with pytest.raises(SystemExit, match="go together"):
        parse_serve_argv(["--model", "/m", "--token-file", "/t", "--group-leader", LEADER, "--", "-tp", "2"])
    with pytest.raises(SystemExit, match="serve: tensor x pipeline parallel 3 ranks"):
        parse_serve_argv(["--model", "/m", "--token-file", "/t", *group, "--pod-rank", "0", "--", "-tp", "3"])


def test_a_rank_waits_for_its_leaders_name_and_gives_up_naming_it() -> None:
    now = [0.0]
    answers = iter([OSError("no such host"), OSError("no such host"), "10.0.0.7"])

    def resolve(host: str) -> object:
        answer = next(answers)
        if isinstance(answer, OSError):
            raise answer
        return answer

    wait_for_address(LEADER, 30, resolve=resolve, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert now[0] == 1.0  # two tries failed, half a second apart

    def never(host: str) -> object:
        raise OSError("no such host")

    with pytest.raises(SystemExit, match=f"leader '{LEADER}' did not resolve in 30s"):
        wait_for_address(
            LEADER, 30, resolve=never, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)
        )
