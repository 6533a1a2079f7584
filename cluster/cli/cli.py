"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from cluster.cli.expert_plan import add_expert_plan


def _add_generate(sub) -> None:
    from cluster.cli.flags import GENERATE_GROUPS, add_cli_flags
    p = sub.add_parser("generate", allow_abbrev=False, help="generate a completion for one prompt",
                       description="Runs the prompt on one in-process engine; a KV-transfer or layout flag, "
                                   "--tp or --config runs it through a cluster of Ray actors instead (started "
                                   "for this prompt, then stopped).")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel ranks per instance: --decode-tp and --prefill-tp, unless given")
    add_cli_flags(p.add_argument_group("cluster spec", "the flags of `pdserve serve` for an instance's engine, the "
                                                       "KV transfer and the layout"),
                  GENERATE_GROUPS, aliases={"num_threads": ("--threads",), "num_prefill": ("--prefill",),
                                            "num_decode": ("--decode",)})
    p.set_defaults(func=cmd_generate)


def _on_cluster(args) -> bool:
    """Whether generate's flags ask for a cluster: a KV-transfer or layout flag, --tp or --config."""
    from cluster.cli.flags import FLAG_GROUPS
    keys = FLAG_GROUPS["kv_transfer"] + FLAG_GROUPS["layout"]
    return args.tp is not None or args.config is not None or any(hasattr(args, key) for key in keys)


def _generate_spec(args):
    """The spec generate runs: its flags over --config over the defaults, `--tp` for both pools where
    --decode-tp / --prefill-tp are not given. A --config file's service keys are serve's: generate runs
    its own local cluster, so they are dropped (named in a warning), never used to join a running one."""
    from dataclasses import replace

    from cluster.cli.flags import FLAG_GROUPS
    from cluster.spec import ClusterSpec
    spec, default = ClusterSpec.from_args(args), ClusterSpec()
    if args.tp is not None:
        spec = replace(spec, decode_tp=getattr(args, "decode_tp", args.tp),
                       prefill_tp=getattr(args, "prefill_tp", args.tp))
    dropped = [key for key in FLAG_GROUPS["service"] if getattr(spec, key) != getattr(default, key)]
    if dropped:
        logging.getLogger(__name__).warning("pdserve generate runs its own cluster: %s of %s not used (pdserve "
                                            "serve's)", ", ".join(dropped), args.config)
        spec = replace(spec, **{key: getattr(default, key) for key in dropped})
    return spec


def _cluster_spec(args):
    """The ClusterSpec of the cluster the flags ask for, or None when they ask for none."""
    return _generate_spec(args) if _on_cluster(args) else None


def _generate_on_cluster(spec, args, params) -> dict:
    """One prompt through a fresh cluster; the same fields as the in-process path."""
    from cluster.control.cluster import Cluster
    from engine.loading.loader import resolve_model_path
    from engine.text.tokenizer import Tokenizer
    tok = Tokenizer.from_path(resolve_model_path(spec.model))
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat \
        else tok.encode(args.prompt)
    with Cluster(spec) as cluster:
        stream = cluster.submit("cli-0", prompt_ids, params).result(timeout=600)
    if stream.error:
        raise RuntimeError(f"generation failed: {stream.error}")
    decode_s = stream.finished_s - stream.first_token_s
    return {"text": tok.decode(stream.token_ids, skip_special_tokens=True), "token_ids": stream.token_ids,
            "prompt_token_ids": prompt_ids, "finish_reason": stream.finish_reason,
            "ttft_s": stream.first_token_s - stream.arrival_s,
            "tokens_per_s": (len(stream.token_ids) - 1) / decode_s if decode_s > 0 else None}


def _generate_in_process(spec, args, params) -> dict:
    """One prompt on one colocated engine of the spec's engine keys (`engine_config("colocated")`)."""
    from decode_worker.engine import ColocatedEngine
    from decode_worker.llm import LLM
    out = LLM(engine=ColocatedEngine(spec.engine_config("colocated"))).generate([args.prompt], params,
                                                                               chat=args.chat)[0]
    return {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason, "ttft_s": out.ttft_s, "tokens_per_s": out.tokens_per_s}


def cmd_generate(args) -> int:
    from engine.core.request import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    spec = _generate_spec(args)  # bad flags are refused here, before anything loads
    run = _generate_on_cluster if _on_cluster(args) else _generate_in_process
    result = run(spec, args, params)
    print(json.dumps(result) if args.json else result["text"])
    return 0


def _add_serve(sub) -> None:
    from cluster.cli.flags import add_cli_flags
    p = sub.add_parser("serve", allow_abbrev=False, help="start the cluster and the OpenAI-compatible HTTP gateway")
    add_cli_flags(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from cluster.cli.serve import serve
    from cluster.spec import ClusterSpec
    return serve(ClusterSpec.from_args(args), log_level=args.log_level.lower())


_PROCESSES = {  # the commands that run one process of a cluster from the spec flags (cluster/cli/serve.py)
    "controller": ("own the instances (start, adopt, replace, scale) for separate gateways",
                   "The cluster's controller: joins Ray (--ray-address), adopts the live instances of its Ray "
                   "namespace or starts them, replaces dead ones, runs the autoscaler. Gateways (`pdserve "
                   "gateway`) find the instances through --redis-url."),
    "gateway": ("a stateless OpenAI-compatible gateway over a controller's instances",
                "Routes over the instances a `pdserve controller` owns, found in the cluster state "
                "(--redis-url); run any number. Instance counts and engine flags are the controller's."),
}


def _add_process(sub, name: str) -> None:
    from cluster.cli.flags import add_cli_flags
    help_, description = _PROCESSES[name]
    p = sub.add_parser(name, allow_abbrev=False, help=help_, description=description)
    add_cli_flags(p)
    p.set_defaults(func=cmd_process)


def cmd_process(args) -> int:
    from cluster.cli import serve
    from cluster.spec import ClusterSpec
    run = {"controller": serve.serve_controller, "gateway": serve.serve_gateway}[args.command]
    return run(ClusterSpec.from_args(args), log_level=args.log_level.lower())


def _add_bench(sub) -> None:
    from cluster.cli.flags import add_cli_flags
    from cluster.loadgen.loadgen import add_flags
    p = sub.add_parser("bench", allow_abbrev=False, help="load-test a running server over HTTP, or --profile one instance",
                       description="Without --profile: stream /v1/completions at a running server and report "
                                   "TTFT, TBT, end-to-end latency, throughput and goodput. With --profile: measure "
                                   "one in-process instance for the autoscaler.")
    p.add_argument("--profile", metavar="OUT.json", default=None,
                   help="measure one instance (prefill tokens/s, decode step time by batch, KV capacity) into OUT.json "
                        "instead of load-testing; takes the cluster spec flags")
    add_flags(p.add_argument_group("load generator", "the default mode: a running server at --url"))
    add_cli_flags(p.add_argument_group("cluster spec", "with --profile: the instance to measure"))
    p.set_defaults(func=cmd_bench)


def run_from_args(args) -> int:
    """`pdserve bench` without --profile: run, print the table, write --out. 1 when no request succeeded."""
    import asyncio
    from cluster.loadgen.loadgen import config_from_args, run_load
    from cluster.loadgen.loadgen_report import Slo, format_table, summarize, write_outputs
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    result = asyncio.run(run_load(config_from_args(args)))
    summary = summarize(result.records, Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo))
    print(format_table(summary))
    if args.out:
        paths = write_outputs(result, summary, args.out)
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if summary["num_ok"] else 1


def cmd_bench(args) -> int:
    from dataclasses import fields
    from cluster.spec import ClusterSpec
    if args.profile is None:
        given = [f"--{f.name.replace('_', '-')}" for f in fields(ClusterSpec) if hasattr(args, f.name)]
        if given or args.config:  # they would be ignored: say so instead
            raise ValueError(f"{', '.join(given or ['--config'])}: cluster spec flags only apply with --profile")
        return run_from_args(args)
    from cluster.autoscale.profiler import measure_profile
    profile, raw = measure_profile(ClusterSpec.from_args(args))
    profile.save(args.profile, **raw)
    print(f"prefill {profile.prefill_tokens_per_s:.0f} tokens/s; decode step {profile.decode_itl_base_s * 1000:.1f} ms "
          f"+ {profile.decode_itl_per_seq_s * 1000:.2f} ms/sequence; KV {profile.kv_capacity_tokens} tokens; "
          f"startup {profile.startup_s:.1f} s -> {args.profile}")
    return 0


def _add_status(sub) -> None:
    p = sub.add_parser("status", allow_abbrev=False, help="the instances of a running server, as a table")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's address")
    p.set_defaults(func=cmd_status)


def _rank_cpu(cpu: dict | None) -> str:
    """" [nice 0, cores 0-1, 2 threads, PASSIVE]" (cluster/ranks/cpu_plan.py cpu_state), or "" when unknown."""
    if not cpu:
        return ""
    return f" [nice {cpu['niceness']}, cores {cpu['cpus']}, {cpu['intraop_threads']} threads, {cpu['omp_wait_policy']}]"


def cmd_status(args) -> int:
    import httpx
    try:
        instances = httpx.get(f"{args.url.rstrip('/')}/status", timeout=10).raise_for_status().json()["instances"]
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot read {args.url}/status: {exc}") from None
    print(f"{'instance':<14}{'role':<11}{'tp':>3}  {'health':<8}{'running':>8}{'waiting':>8}{'queued tok':>11}"
          f"{'KV use':>8}  ranks (node address/pid [nice, cores, intra-op threads, OpenMP wait])")
    for i in instances:
        load = i["load"]
        ranks = " ".join(f"{r['node_ip']}/{r['pid']}{_rank_cpu(r.get('cpu'))}" for r in i.get("ranks", []))
        print(f"{i['instance_id']:<14}{i['role']:<11}{i['tp_size']:>3}  {'ok' if i['healthy'] else 'dead':<8}"
              f"{load.get('running', 0):>8.0f}{load.get('waiting', 0):>8.0f}"
              f"{load.get('queued_prefill_tokens', 0):>11.0f}{load.get('kv_usage', 0):>8.1%}  {ranks}")
    return 0


def _add_hash_api_key(sub) -> None:
    p = sub.add_parser("hash-api-key", allow_abbrev=False, help="print the SHA-256 of an API key read from stdin",
                       description="Reads one API key from stdin (a prompt without echo on a terminal; surrounding "
                                   "whitespace and the newline are dropped, as an HTTP header's are) and prints "
                                   "the hex SHA-256 that --api-keys-file stores (docs/gateway.md). A key of fewer "
                                   "than 16 characters, or one no HTTP client could send, is refused.")
    p.set_defaults(func=cmd_hash_api_key)


def cmd_hash_api_key(args) -> int:
    import getpass

    from gateway.api_keys import check_key_strength, hash_api_key
    key = (getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.read()).strip()
    if not key:
        raise ValueError("hash-api-key: stdin held no key")
    check_key_strength(key, "hash-api-key")  # a keys file holds hashes: here is the one chance to check the key
    print(hash_api_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving",
                                     allow_abbrev=False)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_process(sub, "controller")
    _add_process(sub, "gateway")
    _add_bench(sub)
    _add_status(sub)
    add_expert_plan(sub)
    _add_hash_api_key(sub)
    return parser


def _redis_url_off_argv(args) -> None:
    """`--redis-url` from PDSERVE_REDIS_URL when the flag is absent, and never a password on the
    command line: every local user reads it in the process list, and Ray's job table shows a
    driver's command line as its entrypoint. Refused, naming where it goes instead."""
    from urllib.parse import urlsplit
    from cluster.redis_client import PASSWORD_ENV, PASSWORD_FILE_ENV, URL_ENV, mask_url
    url = getattr(args, "redis_url", None)
    if url and (urlsplit(url).password is not None or "password=" in urlsplit(url).query):
        raise ValueError(f"--redis-url {mask_url(url)} carries a password, which the process list and Ray's job "
                         f"table would show: set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}, or the whole URL in {URL_ENV}")
    if url is None and hasattr(args, "config") and os.environ.get(URL_ENV):  # a command with the spec's flags
        args.redis_url = os.environ[URL_ENV]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _redis_url_off_argv(args)
        return args.func(args)
    except ValueError as exc:  # bad user input: a clear message, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the server has shut down (uvicorn re-raises the signal after)
        return 130


if __name__ == "__main__":
    sys.exit(main())
