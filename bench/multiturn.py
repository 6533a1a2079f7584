"""Multi-turn chat through the HTTP server (issue 51): N sessions x T turns, each turn the whole
conversation so far plus a new user message after a shared system prompt, at most C requests in
flight. Turns go in waves (turn t of every session before turn t+1 of any), so the KV each turn
ships is read per turn from the server's /metrics.

    python -m bench.multiturn                                # every pdserve target, 24 sessions x 4 turns
    python -m bench.multiturn --targets 1P1D,1P1D-off --json
    python -m bench.multiturn --targets vllm                 # vLLM-CPU (prefix caching on): bench/serving_vs_vllm.py

Targets: `1P1D`, `2P2D` (prefix-aware routing) and `colocated` with the KV economics of issue 51
on (delta transfer, a host tier of --tier-gib per rank, the cross-instance fetch), each also `-off`
(`--no-kv-delta`, no tier, `--no-kv-fetch`: every turn ships its whole prompt's KV, and what the
pool evicted is computed again), and
`vllm`. Workload, seeded: a system prompt of
--system-words words, each user message uniform in [--user-words-min, --user-words-max] words of a
fixed list, every reply exactly --output-tokens tokens (greedy, ignore_eos). Each pdserve instance's
KV pool holds about --pool-fraction of the working set (every session's last prompt, counted with
the model's tokenizer), and never less than C of the longest prompts plus their replies. With
--session-header each conversation names itself (x-session-id: the router's session affinity).
With --disk-tier-gib the targets with a host tier have a disk tier under it too, each in a fresh
directory (nothing carried over from another target or run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serving_vs_vllm import REPO, Server, _free_port, run_main, vllm_env
from cluster.loadgen.loadgen import RequestRecord
from cluster.loadgen.loadgen_report import summarize

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education").split()
PDSERVE = {"1P1D": ["--num-prefill", "1", "--num-decode", "1"],
           "2P2D": ["--num-prefill", "2", "--num-decode", "2", "--router-policy", "prefix_aware"],
           "colocated": ["--mode", "colocated"]}
TARGETS = ("1P1D", "1P1D-off", "2P2D", "2P2D-off", "colocated", "colocated-off", "vllm")
COUNTERS = {"kv_bytes": "pdserve_kv_transfer_received_bytes_total",
            "reused_tokens": "pdserve_kv_reused_prompt_tokens_total",
            "tier_reloaded_blocks": "pdserve_kv_host_tier_reloaded_blocks_total",
            "disk_loaded_blocks": "pdserve_kv_disk_tier_loaded_blocks_total",
            # what the router weighs tier hits by (router/prefix_index.py tier_weights), summed over instances
            "reload_s": "pdserve_kv_host_tier_reload_seconds_total", "disk_read_s": "pdserve_kv_disk_tier_read_seconds_total",
            "prefill_tokens": "pdserve_prefill_computed_tokens_total", "prefill_s": "pdserve_prefill_busy_seconds_total",
            # cross-instance fetch (router/fetch.py): prompt tokens fetched from another prefill instance
            "fetched_tokens": "pdserve_kv_fetched_tokens_total", "fetches_failed": "pdserve_kv_fetches_failed_total",
            # the router's decisions (router/fetch.py)
            "fetches_chosen": "pdserve_router_kv_fetches_chosen_total",
            "fetches_declined": "pdserve_router_kv_fetches_declined_total",
            "fetches_not_opened": "pdserve_router_kv_fetches_not_opened_total",
            "fetches_refused": "pdserve_router_kv_fetches_refused_total"}


@dataclass(frozen=True)
class Workload:
    num_sessions: int = 24
    num_turns: int = 4
    concurrency: int = 4
    system_words: int = 150
    user_words_min: int = 20
    user_words_max: int = 80
    output_tokens: int = 32
    seed: int = 0

    def __post_init__(self):
        for name, value in asdict(self).items():
            if value < (0 if name in ("seed", "system_words") else 1):
                raise ValueError(f"--{name.replace('_', '-')} {value} is too small")
        if self.user_words_min > self.user_words_max:
            raise ValueError(f"--user-words-min {self.user_words_min} is over --user-words-max {self.user_words_max}")

    def messages(self) -> tuple[str, list[list[str]]]:
        """The system prompt and each session's user messages, turn by turn."""
        rng = random.Random(self.seed)
        words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
        system = "You are a helpful assistant. " + words(self.system_words)
        return system, [[words(rng.randint(self.user_words_min, self.user_words_max)) for _ in range(self.num_turns)]
                        for _ in range(self.num_sessions)]


def pool_blocks(wl: Workload, block_size: int, fraction: float) -> tuple[int, int]:
    """(blocks per instance, working-set tokens): `fraction` of every session's last prompt plus
    reply, but at least what `concurrency` of the longest need at once (plus the null block)."""
    from engine.text.tokenizer import Tokenizer
    tok = Tokenizer.from_path("smollm2")
    system, users = wl.messages()
    lengths = []
    for turns in users:
        conversation = [{"role": "system", "content": system}]
        for user in turns:
            conversation += [{"role": "user", "content": user}, {"role": "assistant", "content": "x " * wl.output_tokens}]
        lengths.append(len(tok.encode_chat(conversation, add_generation_prompt=False)))
    working_set = sum(lengths)
    need = max(fraction * working_set, wl.concurrency * max(lengths))
    return -(-int(need) // block_size) + 1, working_set


def counters(url: str) -> dict[str, float]:
    """The server's KV counters, summed over its instances (0 where it has none: vLLM)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return {key: sum(s.value for s in samples if s.name == name) for key, name in COUNTERS.items()}


async def _turn(http: httpx.AsyncClient, model: str, conversation: list[dict], wl: Workload,
                record: RequestRecord, clock, session: str | None = None) -> tuple[str, int]:
    """One streamed chat turn into `record` (with `session`, its x-session-id header); returns the
    reply's text and the usage's cached tokens."""
    body = {"model": model, "messages": conversation, "max_tokens": wl.output_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record.send_s, text, cached = clock(), [], 0
    try:
        headers = {"x-session-id": session} if session else None
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                record.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return "", 0
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[len("data:"):])
                for choice in chunk.get("choices") or []:
                    if piece := (choice.get("delta") or {}).get("content"):
                        record.chunk_s.append(clock())
                        text.append(piece)
                if usage := chunk.get("usage"):
                    record.num_completion_tokens, record.num_prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    except Exception as exc:  # a failed turn is counted, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.end_s = clock()
    return "".join(text), cached


async def run_waves(url: str, wl: Workload, session_header: bool = False) -> dict:
    system, users = wl.messages()
    conversations = [[{"role": "system", "content": system}] for _ in users]
    limit = asyncio.Semaphore(wl.concurrency)
    start = time.monotonic()
    clock = lambda: time.monotonic() - start  # noqa: E731
    turns, records = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for t in range(wl.num_turns):
            before, wave = counters(url), []

            async def one(i: int) -> int:
                async with limit:
                    conversations[i].append({"role": "user", "content": users[i][t]})
                    record = RequestRecord(len(records) + i, wl.output_tokens, None, clock())
                    wave.append(record)
                    reply, cached = await _turn(http, model, conversations[i], wl, record, clock,
                                                f"session-{i}" if session_header else None)
                    conversations[i].append({"role": "assistant", "content": reply})
                    return cached
            cached = await asyncio.gather(*(one(i) for i in range(wl.num_sessions)))
            after = counters(url)
            s = summarize(wave)
            turns.append({"turn": t + 1, "prompt_tokens": sum(r.num_prompt_tokens or 0 for r in wave),
                          "cached_tokens": sum(cached), "ttft_p50_s": (s["ttft_s"] or {}).get("p50"),
                          **{k: after[k] - before[k] for k in COUNTERS}, "num_failed": s["num_failed"]})
            records += wave
    s = summarize(records)
    return {"turns": turns, "ttft_p50_s": s["ttft_s"]["p50"] if s["ttft_s"] else None,
            "ttft_p99_s": s["ttft_s"]["p99"] if s["ttft_s"] else None,
            "itl_p50_s": s["inter_chunk_s"]["p50"] if s["inter_chunk_s"] else None,
            "output_tok_s": s["output_token_throughput"], "num_ok": s["num_ok"], "num_failed": s["num_failed"],
            "errors": s["errors"]}


def server_argv(target: str, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str], str]:
    if target == "vllm":
        argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model,
                "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
                # the same pool as pdserve's instances, in blocks of 32 (vLLM-CPU's attention takes no other;
                # pdserve's vllm_cpu backend rounds to them too: engine/core/kv_cache.py blocks_of_size)
                "--block-size", "32", "--num-gpu-blocks-override", str(-(-(args.num_kv_blocks - 1) * args.block_size // 32)),
                "--max-model-len", "2048"]  # a pool this small must hold one request of it
        return argv, vllm_env(args.vllm_python, args.vllm_kv_gib, True), "/v1/models"
    layout, _, off = target.partition("-")
    argv = [sys.executable, "-m", "cluster.cli.cli", "serve", "--dtype", args.dtype, "--host", "127.0.0.1",
            "--port", str(port), "--block-size", str(args.block_size), "--num-kv-blocks", str(args.num_kv_blocks),
            *PDSERVE[layout], *(["--no-kv-delta"] if off else ["--kv-host-tier-gib", f"{args.tier_gib:g}"])]
    if off and layout != "colocated":
        argv.append("--no-kv-fetch")  # (the fetch is issue 51's too)
    if args.disk_tier_gib and not off:
        disk_dir = tempfile.mkdtemp(prefix=f"kv-disk-{target}-", dir=args.log_dir)
        argv += ["--kv-disk-tier-gib", f"{args.disk_tier_gib:g}", "--kv-disk-tier-dir", disk_dir]
    return argv + args.pdserve_arg, {}, "/ready"


def run(args: argparse.Namespace) -> dict:
    wl = args.workload
    args.num_kv_blocks, working_set = pool_blocks(wl, args.block_size, args.pool_fraction)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="multiturn-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    args.log_dir = str(log_dir)
    rows = {}
    for target in args.targets:
        port = _free_port()
        argv, env, ready = server_argv(target, port, args)
        server = Server(target, argv, env, f"http://127.0.0.1:{port}", log_dir / f"{target}.log")
        try:
            server.wait_ready(ready, args.start_timeout)
            rows[target] = row = asyncio.run(run_waves(server.url, wl, args.session_header))
            row["tier_weights"] = measured_weights(row["turns"], args.block_size)
        finally:
            server.stop()
    return {"workload": {**asdict(wl), "block_size": args.block_size, "pool_fraction": args.pool_fraction,
                         "tier_gib": args.tier_gib, "disk_tier_gib": args.disk_tier_gib,
                         "session_header": args.session_header,
                         "num_kv_blocks": args.num_kv_blocks, "working_set_tokens": working_set, "dtype": args.dtype},
            "targets": rows}


def measured_weights(turns: list[dict], block_size: int) -> dict[str, float]:
    """The weights the router would give a host-tier and a disk-tier block (router/prefix_index.py
    tier_weights) from the run's seconds and blocks, summed over its instances and turns."""
    from router.prefix_index import tier_weights
    total = {k: sum(t.get(k, 0.0) for t in turns) for k in COUNTERS}
    return tier_weights({"prefill_tokens_computed": total["prefill_tokens"], "prefill_busy_s": total["prefill_s"],
                         "kv_host_tier_reloaded_blocks": total["tier_reloaded_blocks"],
                         "kv_host_tier_reload_seconds": total["reload_s"],
                         "kv_disk_tier_loaded_blocks": total["disk_loaded_blocks"],
                         "kv_disk_tier_read_seconds": total["disk_read_s"]}, block_size)


def format_table(r: dict) -> str:
    wl = r["workload"]
    lines = [f"{wl['num_sessions']} sessions x {wl['num_turns']} turns, concurrency {wl['concurrency']}, "
             f"{wl['output_tokens']} output tokens, pool {wl['num_kv_blocks']} blocks of {wl['block_size']} "
             f"(working set {wl['working_set_tokens']} tokens)", "",
             f"{'target':<14}{'TTFT p50':>9}{'p99':>7}{'ITL':>6}{'tok/s':>7}  per turn: prompt tok / cached "
             f"(of them reloaded from the host tier; of those, read from disk first) / reused on decode / KV MB "
             f"shipped / TTFT p50 ms / prompt tokens computed (fetched from another prefill instance)"]
    for name, row in r["targets"].items():
        per_turn = "  ".join(f"{t['prompt_tokens']}/{t['cached_tokens']}"
                             f"({t['tier_reloaded_blocks'] * wl['block_size']:.0f}"
                             f";{t.get('disk_loaded_blocks', 0) * wl['block_size']:.0f})/{t['reused_tokens']:.0f}/"
                             f"{t['kv_bytes'] / 1e6:.1f}/{(t['ttft_p50_s'] or 0) * 1000:.0f}/"
                             f"{t.get('prefill_tokens', 0):.0f}({t.get('fetched_tokens', 0):.0f})" for t in row["turns"])
        lines.append(f"{name:<14}{row['ttft_p50_s'] * 1000:>7.0f}ms{row['ttft_p99_s'] * 1000:>6.0f}"
                     f"{row['itl_p50_s'] * 1000:>6.0f}{row['output_tok_s']:>7.1f}  {per_turn}"
                     + (f"  FAILED {row['num_failed']}" if row["num_failed"] else "")
                     + (f"  weights h {row['tier_weights']['h']:.3f} d {row['tier_weights']['d']:.3f}"
                        if "tier_weights" in row else ""))
    return "\n".join(lines)


def parse_targets(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names or set(names) - set(TARGETS):
        raise argparse.ArgumentTypeError(f"unknown target in {text!r} (choose from {', '.join(TARGETS)})")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=parse_targets, default=TARGETS[:-1], help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--tier-gib", type=float, default=1.0, help="the targets' host tier per rank (not the -off ones)")
    p.add_argument("--disk-tier-gib", type=float, default=0.0,
                   help="a disk tier under the host tier of that size per instance (0: none)")
    for name, default in asdict(Workload()).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--session-header", action="store_true",
                   help="each conversation's turns carry an x-session-id header (the server's session affinity)")
    p.add_argument("--pool-fraction", type=float, default=0.2, help="each instance's KV pool, of the working set")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--pdserve-arg", action="append", default=[], metavar="ARG", help="one more `pdserve serve` argument")
    p.add_argument("--vllm-python", default=str(REPO.parent / "vllm-venv" / "bin" / "python"))
    p.add_argument("--vllm-model", default=str(REPO.parent / "smollm2-hf"))
    p.add_argument("--vllm-kv-gib", type=float, default=2.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    args.convert_to = None
    try:
        args.workload = Workload(**{k: getattr(args, k) for k in asdict(Workload())})
    except ValueError as exc:
        p.error(str(exc))
    if args.disk_tier_gib < 0 or args.tier_gib <= 0:
        p.error(f"--tier-gib {args.tier_gib:g} must be > 0 and --disk-tier-gib {args.disk_tier_gib:g} >= 0")
    if not 0 < args.pool_fraction <= 1:
        p.error(f"--pool-fraction {args.pool_fraction} is not in (0, 1]")
    if "vllm" in args.targets and not Path(args.vllm_python).exists():
        p.error(f"--vllm-python {args.vllm_python} does not exist (bench/serving_vs_vllm.py says how to make it)")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main(parse_args(argv), run, format_table)


if __name__ == "__main__":
    sys.exit(main())
