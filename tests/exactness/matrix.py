"""The exactness matrix: the same requests served colocated and disaggregated, compared token by
token and logprob by logprob.

    cases = pairwise_cases()                      # every pair of factor values, allpairspy
    want = serve(model, REFERENCE, ...)           # colocated, tp=1, one request at a time
    got = serve(model, case, ...)                 # the case's layout and knobs
    assert mismatches(got, want) == []            # [] or what differs, request by request

Factors: the layout (1P1D, P tp=1 -> D tp=3, P tp=3 -> D tp=1, 2P2D), the KV block size, a
prefix-cache hit or miss, chunked prefill on or off, preemption (a KV pool too small for every
request at once: it preempts when requests run together), one request at a time or all 8 at once,
the KV dtype (the model's or fp8), a request of n = 3 choices, a structured-output request, the KV
transport (torch.distributed's data channel, or NIXL reads of the prefill's pool). The
servers run in the batch-invariant mode, so a case's greedy tokens and their logprobs must equal
the reference's bit for bit: no tolerance, no near-tie to excuse."""
from __future__ import annotations

from dataclasses import dataclass

from allpairspy import AllPairs

from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.request import SamplingParams
from tests.helpers import random_prompts

LAYOUTS = {  # name -> (mode, num_prefill, num_decode, prefill_tp, decode_tp)
    "colocated": ("colocated", 0, 1, 1, 1),
    "1P1D": ("disaggregated", 1, 1, 1, 1),
    "P1-D3": ("disaggregated", 1, 1, 1, 3),
    "P3-D1": ("disaggregated", 1, 1, 3, 1),
    "2P2D": ("disaggregated", 2, 2, 1, 1),
}
FACTORS = {
    "layout": ["1P1D", "P1-D3", "P3-D1", "2P2D"],
    "block_size": [8, 16],
    "prefix": ["miss", "hit"],
    "chunked": [False, True],
    "preemption": [False, True],
    "concurrency": [1, 8],
    "kv_dtype": ["auto", "fp8_e4m3"],
    "n3": [False, True],
    "structured": [False, True],
    "transport": ["torch", "nixl"],
}
MAX_TOKENS = 10
REGEX = r"[0-9]{1,3}( apples)?"  # the structured request's output


@dataclass(frozen=True)
class Case:
    layout: str = "colocated"
    block_size: int = 16
    prefix: str = "miss"
    chunked: bool = False
    preemption: bool = False
    concurrency: int = 1
    kv_dtype: str = "auto"
    n3: bool = True
    structured: bool = True
    transport: str = "torch"

    @property
    def name(self) -> str:
        return "-".join([self.layout, f"bs{self.block_size}", self.prefix, "chunked" if self.chunked else "whole",
                         "preempt" if self.preemption else "roomy", f"c{self.concurrency}", self.kv_dtype,
                         *(["n3"] if self.n3 else []), *(["structured"] if self.structured else []), self.transport])

    @property
    def needs_ray(self) -> bool:
        return max(LAYOUTS[self.layout][3:]) > 1


def pairwise_cases() -> list[Case]:
    """Every pair of two factors' values in at least one case (not the full product)."""
    return [Case(*row) for row in AllPairs(list(FACTORS.values()))]


def reference(kv_dtype: str) -> Case:
    """What every case is compared with: colocated, tp=1, one request at a time, whole prompts, a
    pool that never preempts, no prefix cache; the case's KV dtype (fp8 rounds the cache itself)."""
    return Case(kv_dtype=kv_dtype)


def requests(case: Case) -> dict[str, tuple[list[int], SamplingParams]]:
    """name -> (prompt, params). Six greedy prompts (three share a 48-token prefix), with the n = 3
    and the structured request when the case has them; top-2 logprobs for every token."""
    prefix = random_prompts(1, [48], seed=11)[0]
    prompts = random_prompts(6, [5, 40, 150, 23, 96, 70], seed=12)
    for i in (1, 3, 4):
        prompts[i] = prefix + prompts[i]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    out = {f"p{i}": (p, greedy) for i, p in enumerate(prompts)}
    if case.n3:
        out["n3"] = (random_prompts(1, [30], seed=13)[0], SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2, n=3))
    if case.structured:
        out["structured"] = (random_prompts(1, [20], seed=14)[0], SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, structured_output=("regex", REGEX)))
    return out


def warm_up_prompt() -> list[int]:
    """A request run before the others in a prefix-hit case: it leaves the shared prefix cached."""
    return random_prompts(1, [48], seed=11)[0] + [7, 8, 9]


def spec_of(case: Case, model: str, batch_invariant: bool = True, **overrides) -> ClusterSpec:
    mode, num_prefill, num_decode, prefill_tp, decode_tp = LAYOUTS[case.layout]
    pool_tokens = 160 if case.preemption else 4096
    return ClusterSpec(**{**dict(
        model=model, dtype="float32", device="cpu", mode=mode, num_prefill=num_prefill, num_decode=num_decode,
        prefill_tp=prefill_tp, decode_tp=decode_tp, block_size=case.block_size,
        num_kv_blocks=pool_tokens // case.block_size + 1, max_num_seqs=16,
        max_num_batched_tokens=32 if case.chunked else 512, enable_prefix_caching=case.prefix == "hit",
        kv_cache_dtype=case.kv_dtype, batch_invariant=batch_invariant, num_threads=1, kv_transfer_timeout_s=30.0,
        router_policy="round_robin", kv_transport=case.transport if mode == "disaggregated" else "auto"),
        **overrides})


Outputs = dict[str, list[tuple[list[int], list[dict[int, float]]]]]  # name -> per choice (tokens, logprobs)


def serve(case: Case, model: str, cluster: Cluster | None = None, counts: dict | None = None,
          **overrides) -> Outputs:
    """The case's requests through a cluster of its spec (started here, unless given); `counts`
    gets the decode instances' preemptions and the KV bytes their TP rank 0 received."""
    own = cluster is None
    if own:
        cluster = Cluster(spec_of(case, model, **overrides), use_ray=case.needs_ray).start()
    try:
        if case.prefix == "hit":
            _check(cluster.generate([warm_up_prompt()], SamplingParams(max_tokens=2, temperature=0.0)))
        reqs = requests(case)
        if case.concurrency == 1:
            streams = [cluster.generate([p], sp, timeout_s=120) for p, sp in reqs.values()]
        else:
            everything = cluster.generate([p for p, _ in reqs.values()], [sp for _, sp in reqs.values()],
                                          timeout_s=120)
            streams, i = [], 0
            for _, sp in reqs.values():
                streams.append(everything[i:i + sp.n])
                i += sp.n
        out = {name: [(s.token_ids, s.logprobs) for s in _check(got)] for name, got in zip(reqs, streams)}
        cluster.assert_no_leaks()
        if counts is not None:
            loads = [i.client.load() for i in cluster.instances.values() if i.role != "prefill"]
            counts["preemptions"] = sum(load.get("num_preemptions", 0) for load in loads)
            counts["kv_bytes_received"] = sum(load.get("kv_bytes_received", 0) for load in loads)  # by TP rank 0
        return out
    finally:
        if own:
            cluster.shutdown()


def _check(streams):
    errors = [s.error for s in streams if s.error is not None]
    assert not errors, errors
    return streams


def mismatches(got: Outputs, want: Outputs) -> list[str]:
    """What differs between a case's outputs and the reference's, request by request: [] when every
    choice's tokens and logprobs are equal, bit for bit."""
    out = []
    for name, choices in got.items():
        for index, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(choices, want[name])):
            where = f"{name}[{index}]"
            if tokens != want_tokens:
                at = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b),
                          min(len(tokens), len(want_tokens)))
                out.append(f"{where}: tokens differ from position {at} ({tokens[at:at + 3]} vs {want_tokens[at:at + 3]})")
            elif logprobs != want_logprobs:
                at = next(i for i, (a, b) in enumerate(zip(logprobs, want_logprobs)) if a != b)
                out.append(f"{where}: logprobs differ at token {at} ({logprobs[at]} vs {want_logprobs[at]})")
        if len(choices) != len(want[name]):
            out.append(f"{name}: {len(choices)} choices, the reference has {len(want[name])}")
    return out
