"""Which ranks hold which experts under expert parallelism, and a plan that balances them by load.

    placement = ExpertPlacement.contiguous(num_experts, num_ranks, sparse_layers)   # the default
    placement = plan(counts, num_ranks, num_replicas=2)      # counts: layer -> tokens per expert
    placement.held(layer, rank)                               # the experts that rank holds there
    rank_loads(counts[layer], placement.layers[layer])        # tokens each rank computes

An expert held by several ranks (a replica of a hot expert, as DeepSeek's EPLB makes) has the
tokens routed to it split among its holders by token index: token t goes to holder t mod n
(engine/layers/moe.py grouped_experts), so every (token, expert) pair is computed once in the instance.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HeldExperts:
    """The experts one rank holds in one layer, and for each which of its holders this rank is."""

    ids: tuple[int, ...]  # ascending
    replica: tuple[tuple[int, int], ...]  # per held expert: (this rank's index among its holders, how many)
    layer_ranks: tuple[tuple[int, ...], ...] = ()  # the layer's whole placement: every rank's ids


@dataclass(frozen=True)
class ExpertPlacement:
    """Per sparse layer, the experts each rank holds (ascending ids); an expert may be on several."""

    num_ranks: int
    layers: dict[int, tuple[tuple[int, ...], ...]]

    def __post_init__(self):
        for layer, ranks in self.layers.items():
            assert len(ranks) == self.num_ranks, f"layer {layer}: {len(ranks)} ranks, not {self.num_ranks}"

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int, layers: list[int]) -> ExpertPlacement:
        """vLLM's default: a run of ids per rank, the first `num_experts % num_ranks` ranks one more."""
        return cls(num_ranks, {layer: tuple(contiguous_experts(num_experts, r, num_ranks) for r in range(num_ranks))
                               for layer in layers})

    def held(self, layer: int, rank: int) -> HeldExperts:
        holders = self.holders(layer)
        ids = self.layers[layer][rank]
        return HeldExperts(ids, tuple((holders[e].index(rank), len(holders[e])) for e in ids), self.layers[layer])

    def holders(self, layer: int) -> dict[int, tuple[int, ...]]:
        """expert -> the ranks holding it, ascending."""
        out: dict[int, list[int]] = {}
        for rank, experts in enumerate(self.layers[layer]):
            for e in experts:
                out.setdefault(e, []).append(rank)
        return {e: tuple(r) for e, r in sorted(out.items())}

    def misfit(self, num_experts: int, sparse_layers: list[int], num_ranks: int) -> str | None:
        """Why this placement cannot run a model of `num_experts` experts in `sparse_layers` on
        `num_ranks` expert-parallel ranks (None: it can)."""
        if self.num_ranks != num_ranks:
            return f"it places experts on {self.num_ranks} ranks, the instance has {num_ranks}"
        if sorted(self.layers) != sorted(sparse_layers):
            return f"it places layers {sorted(self.layers)}, the model's sparse layers are {sorted(sparse_layers)}"
        for layer in self.layers:
            held = set(self.holders(layer))
            if held != set(range(num_experts)):
                missing, extra = sorted(set(range(num_experts)) - held), sorted(held - set(range(num_experts)))
                return f"layer {layer}: experts {missing or extra} {'on no rank' if missing else 'do not exist'}"
            if any(len(set(r)) != len(r) for r in self.layers[layer]):
                return f"layer {layer}: a rank holds an expert twice"
        return None

    def to_json(self) -> str:
        return json.dumps({"num_ranks": self.num_ranks,
                           "layers": {str(k): [list(r) for r in v] for k, v in sorted(self.layers.items())}})

    @classmethod
    def from_json(cls, text: str, source: str = "placement") -> ExpertPlacement:
        """Raises ValueError, naming `source`, for anything but {"num_ranks": n, "layers": {layer: [[ids]...]}}."""
        try:
            data = json.loads(text)
            num_ranks = int(data["num_ranks"])
            layers = {int(k): tuple(tuple(sorted(int(e) for e in r)) for r in v) for k, v in data["layers"].items()}
            return cls(num_ranks, layers)
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError) as exc:
            raise ValueError(f"{source}: not an expert placement ({type(exc).__name__}: {exc})") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ExpertPlacement:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"expert placement {path}: no such file")
        return cls.from_json(path.read_text(), str(path))


def contiguous_experts(num_experts: int, rank: int, num_ranks: int) -> tuple[int, ...]:
    """The experts rank `rank` of `num_ranks` holds by default: a contiguous run of ids, the first
    `num_experts % num_ranks` ranks one more."""
    base, extra = divmod(num_experts, num_ranks)
    start = rank * base + min(rank, extra)
    return tuple(range(start, start + base + (rank < extra)))


def rank_loads(counts: list[int], ranks: tuple[tuple[int, ...], ...]) -> list[float]:
    """Tokens each rank computes in one layer: each expert's count, shared evenly by its holders."""
    holders: dict[int, int] = {}
    for experts in ranks:
        for e in experts:
            holders[e] = holders.get(e, 0) + 1
    return [sum(counts[e] / holders[e] for e in experts) for experts in ranks]


def imbalance(loads: list[float]) -> float:
    """max over mean: 1.0 when even (or empty); how much longer the busiest takes than an even split."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def plan(counts: dict[int, list[int]], num_ranks: int, num_replicas: int = 0) -> ExpertPlacement:
    """A placement that balances the ranks' loads, layer by layer (EPLB's greedy, without its node
    groups): `num_replicas` extra copies go one by one to the expert with the most tokens per copy,
    then the copies, heaviest first, each to the least loaded rank that still has a free slot (every
    rank gets (experts + replicas) / ranks slots, so the weights' memory stays even).

    Args:
        counts: layer -> tokens routed to each expert (a recording: /status, `pdserve expert-plan`).
        num_replicas: extra copies per layer; experts + replicas must divide by num_ranks.
    """
    layers = {}
    for layer, per_expert in counts.items():
        num_experts = len(per_expert)
        if (num_experts + num_replicas) % num_ranks:
            raise ValueError(f"{num_experts} experts + {num_replicas} replicas do not fill {num_ranks} ranks evenly")
        if num_replicas > num_experts * (num_ranks - 1):
            raise ValueError(f"{num_replicas} replicas: more than {num_ranks - 1} extra copies of each expert")
        copies = [1] * num_experts
        for _ in range(num_replicas):  # the most tokens per copy, among experts on fewer ranks than all
            e = max((e for e in range(num_experts) if copies[e] < num_ranks),
                    key=lambda e: (per_expert[e] / copies[e], -e))
            copies[e] += 1
        slots = (num_experts + num_replicas) // num_ranks
        share = [per_expert[e] / copies[e] for e in range(num_experts)]
        items = sorted((e for e in range(num_experts) for _ in range(copies[e])), key=lambda e: (-share[e], e))
        held = pack(items, share, num_ranks, slots)
        layers[layer] = tuple(tuple(sorted(r)) for r in held)
    return ExpertPlacement(num_ranks, layers)


def pack(items: list[int], share: list[float], num_ranks: int, slots: int) -> list[list[int]]:
    """Each item (an expert's copy, heaviest first) to the least loaded rank with a free slot that
    lacks that expert. Where every rank with a free slot holds it already, a full rank lacking it
    hands one of its experts to the least loaded free rank and takes this copy instead.

    Args:
        share: per expert, the load of one copy. slots: experts per rank; len(items) == num_ranks * slots.
    """
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots and e not in held[r]]
        if free:
            r = min(free, key=lambda r: (loads[r], r))
        else:
            r = min((r for r in range(num_ranks) if len(held[r]) < slots), key=lambda r: (loads[r], r))
            q = min((q for q in range(num_ranks) if e not in held[q]), key=lambda q: (loads[q], q))
            x = next(x for x in held[q] if x not in held[r])
            held[q].remove(x)
            held[r].append(x)
            loads[q], loads[r], r = loads[q] - share[x], loads[r] + share[x], q
        held[r].append(e)
        loads[r] += share[e]
    return held


def placement_for(config, model_config, tp) -> ExpertPlacement | None:
    """Expert parallelism's placement for a runner (`config.expert_placement`, else a contiguous run
    of experts per rank), checked against the model; None: tensor parallelism."""
    moe = model_config.moe
    if not config.expert_parallel or moe is None:
        return None
    sparse, size = model_config.sparse_layers, tp.size if tp is not None else 1
    placement = config.expert_placement or ExpertPlacement.contiguous(moe.num_experts, size, sparse)
    if (why := placement.misfit(moe.num_experts, sparse, size)) is not None:
        raise ValueError(f"--expert-placement cannot run {model_config.name}: {why}")
    return placement
