"""The processes: `pdserve serve` (controller and OpenAI-compatible gateway in one process),
`pdserve controller` (the instances' owner, alone) and `pdserve gateway` (a stateless gateway over
a controller's instances; any number). Cluster wires the gateway on top of the router, so this
lives in the top layer."""
from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import jinja2
import torch

from cluster.control import model_fit
from cluster.control.cluster import Cluster
from cluster.control.ray_watch import RayMembershipWatch
from cluster.redis_client import URL_ENV, connection_options
from cluster.ranks import cpu_plan
from cluster.spec import ClusterSpec
from engine.core.config import resolve_dtype
from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from gateway.api_keys import KEYS_POLL_S, APIKey, KeysFileWatcher, check_key_strength, configured_keys
from gateway.app import create_app
from gateway.drain import Drain
from gateway.limit_scripts import SharedLimits
from gateway.limits import REDIS_TIMEOUT_S
from kvtransfer.registry import transport_unavailable

logger = logging.getLogger(__name__)


def build(spec: ClusterSpec, api_key: str | None = None, use_ray: bool = True):
    """Starts the cluster; returns (cluster, app). The caller shuts the cluster down."""
    access = gateway_access(spec, api_key)  # a keys file that does not parse is refused before anything starts
    model_fit.check(spec)  # a config or TP size pdserve cannot run is refused before anything starts
    if (why := transport_unavailable(spec.kv_transport)) is not None:  # an optional package it needs is missing
        raise ValueError(why)
    tokenizer = gateway_tokenizer(spec)
    cluster = Cluster(spec, use_ray=use_ray).start()
    if use_ray:  # after Ray started here: its processes would inherit these cores, the ranks' too
        cpu_plan.keep_off_ranks(spec)
    if spec.autoscale:
        from cluster.autoscale.autoscale_loop import create_autoscaler
        cluster.autoscaler = create_autoscaler(cluster, spec).start()
    app = create_app(cluster, tokenizer, spec.model, cluster.max_model_len, None, spec.tool_call_parser,
                     spec.reasoning_parser, **access)
    logger.info("gateway: %s", _describe_keys(access["api_keys"]))
    return cluster, app


def _single_key(spec: ClusterSpec, api_key: str | None) -> str | None:
    """The one key of `--api-key` (the caller's, else the spec's, else $PDSERVE_API_KEY)."""
    return api_key or spec.api_key or os.environ.get("PDSERVE_API_KEY")


def gateway_access(spec: ClusterSpec, api_key: str | None) -> dict:
    """create_app's keys, bounds, session affinity and timings: the keys file's keys plus `api_key` as
    the key named "default". Raises ValueError (one line) for a keys file that does not parse, or an `api_key`
    too weak to take (gateway/api_keys.py check_key_strength)."""
    if api_key is not None:
        check_key_strength(api_key, "--api-key/$PDSERVE_API_KEY")
    return {"api_keys": configured_keys(api_key, spec.api_keys_file), "max_request_bytes": spec.max_request_bytes,
            "max_prompt_tokens": spec.max_prompt_tokens, "session_affinity": spec.session_affinity,
            "return_timings": spec.return_timings,
            "shared_limits": shared_limits(spec.redis_url or os.environ.get(URL_ENV))}


def shared_limits(url: str | None) -> SharedLimits | None:
    """The API keys' limits held for every gateway in the cluster state's Redis at `url` (its credentials
    and TLS from the environment, cluster/redis_client.py); None without one (memory:// or none)."""
    if url is None or not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    import redis.asyncio
    return SharedLimits(redis.asyncio.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                                                     socket_connect_timeout=REDIS_TIMEOUT_S,
                                                     **connection_options(url, os.environ)))


def watch_keys(app, spec: ClusterSpec, api_key: str | None, interval_s: float = KEYS_POLL_S) -> KeysFileWatcher | None:
    """With a keys file: re-reads it into the running app's keys when it changes, and at once on
    SIGHUP (from the main thread only, where signals can be handled); None without one."""
    if spec.api_keys_file is None:
        return None
    watcher = KeysFileWatcher(spec.api_keys_file, app.state.api_keys, configured_keys(api_key, None), interval_s)
    watcher.start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, lambda *_: watcher.reload_soon())
    return watcher


def _describe_keys(keys: list[APIKey]) -> str:
    """For the start-up log line: the keys' names (never the keys)."""
    return f"API keys {', '.join(k.name for k in keys)}" if keys else "no API key: the API is open"


def gateway_tokenizer(spec: ClusterSpec) -> Tokenizer:
    """The model's tokenizer, with `spec.chat_template` in place of its chat template when given."""
    tokenizer = Tokenizer.from_path(resolve_model_path(spec.model))
    if spec.chat_template is not None:
        path = Path(spec.chat_template)
        if not path.is_file():
            raise ValueError(f"chat_template {spec.chat_template!r} is not a file")
        try:
            tokenizer.set_chat_template(path.read_text())
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat_template {spec.chat_template!r}: {exc}") from None
    return tokenizer


def _need_shared_cluster(spec: ClusterSpec, command: str) -> None:
    if spec.ray_address is None or spec.redis_url is None:
        raise ValueError(f"pdserve {command} needs --ray-address and --redis-url: the controller and the gateways "
                         "are separate processes that meet in Ray and the cluster state")


def run_server(app, spec: ClusterSpec, log_level: str, starting=None, drain: bool = False) -> int:
    """Serves `app` until SIGTERM/SIGINT. `starting()` (if given) runs on a thread once the port
    is open (probes answer meanwhile); when it raises, the server stops and 1 is returned.
    `drain`: a gateway's; on the signal it drains for up to `spec.drain_timeout_s` (gateway/drain.py)
    before it stops, instead of cutting what runs after 5 s."""
    import uvicorn
    if drain:
        app = Drain(app, spec.drain_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host=spec.host, port=spec.port, log_level=log_level,
                                           timeout_graceful_shutdown=app.grace_s if drain else 5))
    if drain:
        app.attach(server)
    failed = threading.Event()

    def start() -> None:
        try:
            starting()
        except Exception:
            logger.exception("start-up failed")
            failed.set()
            server.should_exit = True
    if starting is not None:
        threading.Thread(target=start, daemon=True, name="start-up").start()
    server.run()
    return 1 if failed.is_set() else 0


def serve_controller(spec: ClusterSpec, log_level: str = "info") -> int:
    """`pdserve controller`: adopts or starts the instances, watches and replaces them, runs the
    autoscaler; answers /health, /ready (every instance up), /status and /metrics on host:port.
    On exit the instances keep serving: the next controller adopts them."""
    from cluster.cli.controller_app import create_controller_app
    from cluster.control.controller import Controller, init_ray
    _need_shared_cluster(spec, "controller")
    cpu_plan.keep_off_ranks(spec)
    init_ray(spec, log_level.upper())  # here, on the main thread: Ray installs its signal handlers
    controller = Controller(spec, log_level=log_level.upper(), wait_for_room=True)
    app, started = create_controller_app(controller)

    def start() -> None:
        controller.start()
        if spec.autoscale:
            from cluster.autoscale.autoscale_loop import create_autoscaler
            controller.autoscaler = create_autoscaler(controller, spec).start()
        started.set()
    logger.info("pdserve controller: %s, Ray namespace %s; health at http://%s:%d/health", spec.model,
                spec.cluster_name, spec.host, spec.port)
    membership = RayMembershipWatch.of_this_process("pdserve controller").start()
    try:
        return run_server(app, spec, log_level, start)
    finally:
        membership.stop()
        controller.shutdown(stop_instances=False)


def serve_gateway(spec: ClusterSpec, api_key: str | None = None, log_level: str = "info") -> int:
    """`pdserve gateway`: routes over the instances of the cluster state (a controller owns them)."""
    from cluster.control.frontend import Frontend
    _need_shared_cluster(spec, "gateway")
    access = gateway_access(spec, _single_key(spec, api_key))
    cpu_plan.keep_off_ranks(spec)
    tokenizer = gateway_tokenizer(spec)
    frontend = Frontend(spec, log_level=log_level.upper()).start()
    app = create_app(frontend, tokenizer, spec.model, None, None, spec.tool_call_parser, spec.reasoning_parser,
                     **access)
    logger.info("pdserve gateway %s: OpenAI API at http://%s:%d/v1 (%d instances known; %s)", frontend.router.client_id,
                spec.host, spec.port, len(frontend.instances), _describe_keys(access["api_keys"]))
    watcher = watch_keys(app, spec, _single_key(spec, api_key))
    membership = RayMembershipWatch.of_this_process("pdserve gateway").start()
    try:
        return run_server(app, spec, log_level, drain=True)
    finally:
        membership.stop()
        if watcher is not None:
            watcher.stop()
        frontend.shutdown()


def serve_in_thread(app, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
    """Runs `app` on uvicorn in a daemon thread on a free port (tests and benchmarks).

    Returns:
        (base url "http://host:port", stop): `stop()` shuts the server down and joins the thread.
    """
    import socket
    import time

    import uvicorn
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
    return f"http://{host}:{port}", stop


def _paths(spec: ClusterSpec) -> str:
    """Device, dtype and attention backend the instances run (as they resolve "auto")."""
    cuda = spec.device.startswith("cuda") or (spec.device == "auto" and torch.cuda.is_available())
    attention = spec.attention_backend if spec.attention_backend != "auto" else (
        "flash_attn if importable, else flex" if cuda else "vllm_cpu where it fits, else torch")
    dtype = str(resolve_dtype(spec.dtype, torch.device("cuda" if cuda else "cpu"))).removeprefix("torch.")
    return f"{'cuda' if cuda else 'cpu'}, {dtype}{' (auto)' if spec.dtype == 'auto' else ''}, attention {attention}"


def serve(spec: ClusterSpec, api_key: str | None = None, log_level: str = "info") -> int:
    cluster, app = build(spec, _single_key(spec, api_key))
    watch_keys(app, spec, _single_key(spec, api_key))  # a daemon thread: it ends with the process
    counts = ", ".join(f"{n} {role} (tp={spec.tp_size(role)})" for role, n in spec.instance_counts.items())
    logger.info("pdserve: %s on %s [%s]", spec.model, counts, _paths(spec))
    logger.info("OpenAI API at http://%s:%d/v1", spec.host, spec.port)
    try:
        return run_server(app, spec, log_level, drain=True)
    finally:
        cluster.shutdown()
