"""The launcher: vLLM's OpenAI-compatible server, in-process, with Rollfleet's additions.

It follows vLLM's own ``run_server`` (vllm/entrypoints/launchers/api_server/entry.py)
step by step and adds, between building the app and serving it: the generate hook
(caller id -> vLLM id), the /rollfleet/v1 routes and the access middleware. The HTTP
socket only serves once the model is loaded, so /health and /rollfleet/v1/ready cannot
pass before that.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollfleet_engine.access import AccessPolicy, read_token
from rollfleet_engine.group import group_args, last_int, wait_for_address
from rollfleet_engine.protocol import ENGINE_PORT, HTTP_WEIGHT_BACKEND

# Defaults that let a small model run on a CPU-only host; any of them can be
# overridden by the extra vLLM arguments after "--" (argparse keeps the last value).
# float32: vLLM's bf16 CPU kernels crash on CPUs without AVX512-BF16 (these test hosts).
CPU_VLLM_DEFAULTS = [
    "--gpu-memory-utilization",
    "0.3",
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--dtype",
    "float32",
]
CPU_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # "auto" pins every engine of a host to the same first cores (it cannot know about the
    # others); the CPU image runs several small engines per host, which must share them.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # One OpenMP thread per engine. Unset, torch starts one per host core, and an engine's threads
    # spin at every barrier against its own API server and engine core and against the other engines of
    # the host: measured on 2 cores, 1 engine decoded 64 tokens/s with 2 threads and 129 with 1; 2
    # engines 47 against 218, 3 engines 32 against 196 (docs/engine.md). A bigger CPU engine sets its
    # own in the fleet's engine.env.
    "OMP_NUM_THREADS": "1",
    # --enforce-eager does not cover the sampler's logprob ranking, a torch.compile'd helper: inductor
    # needs a C++ compiler, which the CPU image lacks (the engine crashed on the first request for
    # logprobs), and compiling costs each new engine seconds. Eager runs the same arithmetic.
    "TORCHDYNAMO_DISABLE": "1",
    # The engine core and its worker are forked, and so inherit torch and vLLM imported; spawned, each imports
    # them again: an engine's start took 30 CPU-seconds spawned and 14 forked (docs/engine.md). vLLM's CPU
    # platform sets spawn whatever the environment says; `keep_start_method` puts this back. A GPU engine
    # spawns (below): CUDA cannot be used in a forked child.
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
}


# vLLM's message queues on a CPU host (bound_message_queue_waits): a reader spins this long after a read, then
# rechecks its queue this often while its engine steps, and this often once it has idled this long. Measured on 2
# cores, 2 forked engines (docs/engine.md): 8 streams each decoded 1,340-1,936 tokens/s together, with no stall.
QUEUE_SPIN_S = 0.005
QUEUE_RECHECK_BUSY_MS = 10
QUEUE_RECHECK_IDLE_MS = 100
QUEUE_IDLE_AFTER_S = 1.0

# How long a rank of a multi-pod engine waits for its leader's name (the leader pod may be scheduled last).
LEADER_RESOLVE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServeOptions:
    model: str
    served_model_name: str
    host: str
    port: int
    token_file: str | None  # None only for a headless rank (it serves no routes)
    inference_token_file: str | None
    allow_unsafe_routes: bool
    weight_version: str | None
    weight_backend: str | None
    device: str
    vllm_args: list[str]
    headless: bool = False
    group_leader: str | None = None  # a rank of a multi-pod engine: where its leader is (rollfleet_engine.group)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (or hub name)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: the model)")
    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to bind (default: every address of the pod: its IP, and localhost for kubectl port-forward)",
    )
    parser.add_argument("--port", type=int, default=ENGINE_PORT)
    parser.add_argument(
        "--token-file", default=None, help="file holding the control routes' bearer token (not with --headless)"
    )
    parser.add_argument(
        "--inference-token-file", default=None, help="if set, inference routes need this token (or the control token)"
    )
    parser.add_argument(
        "--allow-unsafe-routes", action="store_true", help="enable /collective_rpc and other arbitrary-code routes"
    )
    parser.add_argument("--weight-version", default=None, help="version label of the weights loaded at start")
    parser.add_argument(
        "--weight-backend",
        default=HTTP_WEIGHT_BACKEND,
        help="vLLM weight transfer backend: 'http' (portable), 'nccl' (GPU clusters), 'gloo' (nccl's protocol on "
        "CPU; both from this package's collective_backend) or 'none'",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "gpu"], default="auto", help="'cpu' applies small-host vLLM defaults"
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="a rank of a multi-pod engine that is not its leader: vLLM's headless mode (its workers for tensor or "
        "pipeline parallel ranks, or its engine cores for data parallel ones), no HTTP; the leader serves",
    )
    group = parser.add_argument_group("multi-pod engine (the operator sets these from LWS's environment)")
    group.add_argument("--group-leader", default=None, help="address of the group's leader pod (LWS_LEADER_ADDRESS)")
    group.add_argument("--group-pods", type=int, default=None, help="pods in the group (LWS_GROUP_SIZE)")
    group.add_argument("--pod-rank", type=int, default=None, help="this pod's rank, 0 the leader (LWS_WORKER_INDEX)")


def options_from_args(ns: argparse.Namespace, extra: Sequence[str] = ()) -> ServeOptions:
    """Options from our parsed flags and the extra vLLM arguments (those after '--')."""
    backend = None if ns.weight_backend == "none" else ns.weight_backend
    if ns.token_file is None and not ns.headless:
        raise SystemExit("serve needs --token-file: the engine's control routes ask for its token")
    extra = list(extra) + _group_flags(ns, extra)
    return ServeOptions(
        model=ns.model,
        served_model_name=ns.served_model_name or ns.model,
        host=ns.host,
        port=ns.port,
        token_file=ns.token_file,
        inference_token_file=ns.inference_token_file,
        allow_unsafe_routes=ns.allow_unsafe_routes,
        weight_version=ns.weight_version,
        weight_backend=backend,
        device=ns.device,
        vllm_args=extra,
        headless=ns.headless,
        group_leader=ns.group_leader,
    )


def _group_flags(ns: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    """vLLM's multi-node flags for a pod of a group (none for an engine of one pod)."""
    group = (ns.group_leader, ns.group_pods, ns.pod_rank)
    if group == (None, None, None):
        return []
    if None in group:
        raise SystemExit(
            "serve: --group-leader, --group-pods and --pod-rank go together (a rank of a multi-pod engine)"
        )
    if ns.headless != (ns.pod_rank > 0):
        raise SystemExit(
            f"serve: --pod-rank {ns.pod_rank} {'needs' if ns.pod_rank else 'cannot be'} --headless: "
            "the leader (rank 0) serves, the other ranks run headless"
        )
    try:
        return group_args(extra, ns.group_leader, ns.group_pods, ns.pod_rank)
    except ValueError as err:
        raise SystemExit(f"serve: {err}") from err


def vllm_argv(opts: ServeOptions, on_cpu: bool) -> list[str]:
    """The argument list handed to vLLM's own server parser."""
    argv = [
        "--model",
        opts.model,
        "--served-model-name",
        opts.served_model_name,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        # The token-in/token-out generate route: the gateway's failover continues a request
        # on another engine from the tokens already generated through it.
        "--enable-scale-out",
    ]
    if opts.weight_backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": opts.weight_backend})]
    if on_cpu:
        argv += CPU_VLLM_DEFAULTS
    return argv + opts.vllm_args


def pipeline_problem(model: str, vllm_args: Sequence[str]) -> str | None:
    """Why the model cannot be split into the pipeline stages asked for (None: it can, or the model is not a local
    directory to read). vLLM itself gives such a stage no layers and fails later, without saying why."""
    try:
        stages = last_int(vllm_args, ("--pipeline-parallel-size", "-pp"), 1)
    except ValueError as err:
        return str(err)
    config_file = os.path.join(model, "config.json")
    if stages <= 1 or not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
    if isinstance(layers, int) and stages > layers:
        return (
            f"--pipeline-parallel-size {stages} is more stages than the model's {layers} layers (num_hidden_layers in "
            f"{config_file}): each stage needs at least one layer; lower the fleet's engine.pipelineParallelSize"
        )
    return None


def _on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def keep_start_method() -> None:
    """Start the engine core and workers as VLLM_WORKER_MULTIPROC_METHOD says, on a CPU host too.

    vLLM's CPU platform overwrites the variable with "spawn" when it checks the engine's config, after the
    environment was read; this puts the engine's choice back once that check is done.
    """
    from vllm.platforms.cpu import CpuPlatform

    method = os.environ["VLLM_WORKER_MULTIPROC_METHOD"]
    check = CpuPlatform.check_and_update_config.__func__

    def check_then_keep(cls: type[CpuPlatform], vllm_config: Any) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method

    CpuPlatform.check_and_update_config = classmethod(check_then_keep)


def bound_message_queue_waits() -> None:
    """Make the readers of vLLM's shared-memory message queues (the worker waiting for a step, the engine core
    for its output) spin briefly and never sleep long on a notification that can be lost.

    A reader spins on `sched_yield` for a second after each read, then sleeps on a ZMQ socket until its writer's
    notification, or vLLM's recheck 5 s later. The notifications are best effort (PUB with a high-water mark of 1
    to a conflating SUB: vLLM #45224) and on a CPU host many are lost: a forked engine stalled 5 s at one step in
    four once a stall had let both sides' spins lapse, and a second's spin takes a core from the steps' own work on
    a host with few (docs/engine.md). So a reader spins `QUEUE_SPIN_S` and rechecks its queue every
    `QUEUE_RECHECK_BUSY_MS` while steps come, every `QUEUE_RECHECK_IDLE_MS` once its engine idles. The engine core
    and worker are forked after this and inherit it.
    """
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    init, wait = SpinCondition.__init__, SpinCondition.wait

    def init_with_short_spin(self: SpinCondition, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **(kwargs | {"busy_loop_s": QUEUE_SPIN_S}))

    def wait_bounded(self: SpinCondition, timeout_ms: int | None = None) -> None:
        idle = time.monotonic() - self.last_read >= QUEUE_IDLE_AFTER_S
        bound = QUEUE_RECHECK_IDLE_MS if idle else QUEUE_RECHECK_BUSY_MS
        wait(self, bound if timeout_ms is None else min(timeout_ms, bound))

    SpinCondition.__init__ = init_with_short_spin
    SpinCondition.wait = wait_bounded


def serve(opts: ServeOptions) -> None:
    """Run the engine until SIGTERM/SIGINT."""
    problem = pipeline_problem(opts.model, opts.vllm_args)
    if problem is not None:
        raise SystemExit(f"rollfleet engine: {problem}")
    if opts.group_leader is not None:
        wait_for_address(opts.group_leader, LEADER_RESOLVE_TIMEOUT_S)
    # These must be set before vLLM reads its environment: the RL control routes exist only in dev mode,
    # and on a GPU the engine core must be spawned, not forked (CUDA cannot be used in a forked child).
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    on_cpu = _on_cpu(opts.device)
    if on_cpu:
        for key, value in CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # Telling the platform apart imported torch, whose OpenMP read its thread count then; the engine
        # core, started later, reads the environment.
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        keep_start_method()
        bound_message_queue_waits()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    import uvloop
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM server (Rollfleet engine)"))
    vargs = parser.parse_args(vllm_argv(opts, on_cpu))
    configure_logging_from_args(vargs)
    validate_parsed_serve_args(vargs)
    if opts.headless:
        from vllm.entrypoints.cli.serve import run_headless

        vargs.headless, vargs.api_server_count = True, 0
        run_headless(vargs)  # until SIGTERM, or until the leader goes
        return
    assert opts.token_file is not None
    policy = AccessPolicy(
        control_token=read_token(opts.token_file),
        inference_token=read_token(opts.inference_token_file) if opts.inference_token_file else None,
        allow_unsafe_routes=opts.allow_unsafe_routes,
    )
    uvloop.run(_run(vargs, opts, policy))


async def _run(vargs: argparse.Namespace, opts: ServeOptions, policy: AccessPolicy) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.launcher import setup_server

    listen_address, sock = setup_server(vargs, reuse_port=False)
    try:
        async with build_async_engine_client(vargs) as engine:
            shutdown_task = await _build_and_serve(engine, listen_address, sock, vargs, opts, policy)
        await shutdown_task
    finally:
        sock.close()


async def _build_and_serve(
    engine: Any, listen_address: str, sock: Any, vargs: argparse.Namespace, opts: ServeOptions, policy: AccessPolicy
) -> Any:
    """vLLM's ``build_and_serve`` plus the Rollfleet hook, routes and middleware."""
    from vllm import envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
    from vllm.logger import init_logger

    from rollfleet_engine.engine_hooks import install_generate_hook
    from rollfleet_engine.middleware import RollfleetMiddleware
    from rollfleet_engine.rank_staging import GroupStager
    from rollfleet_engine.routes import router
    from rollfleet_engine.runtime import Runtime

    runtime = Runtime(
        engine=engine, policy=policy, model_name=opts.served_model_name, weight_backend=opts.weight_backend
    )
    if opts.group_leader is not None:
        runtime.stager = GroupStager(engine)  # a staged copy would be this pod's only: each rank stages its own
    install_generate_hook(engine, runtime.tracker, lambda: runtime.weight_version)
    if opts.weight_version is not None:
        await engine.update_weight_version(opts.weight_version)
    await runtime.refresh_weight_version()

    supported_tasks = await engine.get_supported_tasks()
    app = build_app(vargs, supported_tasks, engine.model_config)
    app.include_router(router)
    app.state.rollfleet = runtime
    # Outermost layer, so a refused call reaches no vLLM code. vLLM's SageMaker
    # bootstrap may already have built Starlette's middleware stack; then wrap it.
    if app.middleware_stack is None:
        app.add_middleware(RollfleetMiddleware, runtime=runtime)
    else:
        app.middleware_stack = RollfleetMiddleware(app.middleware_stack, runtime)
    await init_app_state(engine, app.state, vargs, supported_tasks)

    uvicorn_kwargs: dict[str, Any] = {}
    log_config = get_uvicorn_log_config(vargs)
    if log_config is not None:
        uvicorn_kwargs["log_config"] = log_config
    init_logger("rollfleet_engine").info(
        "Rollfleet engine on %s (unsafe routes %s, inference token %s)",
        listen_address,
        "on" if policy.allow_unsafe_routes else "off",
        "required" if policy.inference_token else "not required",
    )
    return await serve_http(
        app,
        sock=sock,
        enable_ssl_refresh=vargs.enable_ssl_refresh,
        host=vargs.host,
        port=vargs.port,
        log_level=vargs.uvicorn_log_level,
        access_log=not vargs.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=vargs.ssl_keyfile,
        ssl_certfile=vargs.ssl_certfile,
        ssl_ca_certs=vargs.ssl_ca_certs,
        ssl_cert_reqs=vargs.ssl_cert_reqs,
        ssl_ciphers=vargs.ssl_ciphers,
        h11_max_incomplete_event_size=vargs.h11_max_incomplete_event_size,
        h11_max_header_count=vargs.h11_max_header_count,
        **uvicorn_kwargs,
    )


def parse_serve_argv(argv: Sequence[str]) -> ServeOptions:
    """``[our flags] [-- extra vLLM flags]``."""
    argv = list(argv)
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m rollfleet_engine serve")
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(ours), extra)
