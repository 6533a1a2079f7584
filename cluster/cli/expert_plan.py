"""`pdserve expert-plan`: a recording of expert loads turned into a placement for
`--expert-placement` (engine/core/expert_placement.py plan).

    pdserve expert-plan http://gateway:8000 --ranks 4 --replicas 8 -o placement.json
    pdserve expert-plan status.json --ranks 4          # a saved /status, or {"layers": {layer: counts}}

A gateway's /status (live, or saved) gives each instance's tokens per expert per sparse layer; the
plan balances the sum over its instances. Printed per layer: the ranks' imbalance (max over mean of
the tokens each computes) with the default contiguous placement, and with the plan.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def add_expert_plan(sub) -> None:
    p = sub.add_parser("expert-plan", allow_abbrev=False,
                       help="turn a mixture's recorded expert loads into a placement for --expert-placement")
    p.add_argument("source", help="a gateway's address (its /status is read), or a JSON file: a saved /status, "
                                  'or {"layers": {layer: [tokens per expert]}}')
    p.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks of the instance that will run it")
    p.add_argument("--replicas", type=int, default=0,
                   help="extra copies of the hottest experts per layer (experts + replicas must divide by --ranks)")
    p.add_argument("-o", "--output", default=None, help="the placement file (default: standard output)")
    p.set_defaults(func=cmd_expert_plan)


def read_counts(source: str) -> dict[int, list[int]]:
    """layer -> tokens per expert, summed over the instances of a /status (live or saved), or read
    from a {"layers": ...} recording. Raises ValueError naming the source."""
    if source.startswith(("http://", "https://")):
        import httpx
        try:
            data = httpx.get(f"{source.rstrip('/')}/status", timeout=10).raise_for_status().json()
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot read {source}/status: {exc}") from None
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{source}: no such file (and not an http(s) address)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        recordings = []
    elif "instances" in data:  # a /status: every instance's counts (null for one that did not answer)
        recordings = [i.get("expert_counts") or {} for i in data["instances"]]
    else:
        recordings = [data.get("layers", {})]
    counts: dict[int, list[int]] = {}
    for recording in recordings:
        for layer, per_expert in recording.items():
            total = counts.setdefault(int(layer), [0] * len(per_expert))
            if len(total) != len(per_expert):
                raise ValueError(f"{source}: layer {layer} has {len(per_expert)} experts in one recording, "
                                 f"{len(total)} in another")
            counts[int(layer)] = [a + int(b) for a, b in zip(total, per_expert)]
    if not counts:
        raise ValueError(f"{source}: no expert counts in it (a dense model's /status, or not a recording)")
    return counts


def cmd_expert_plan(args) -> int:
    from engine.core.expert_placement import ExpertPlacement, imbalance, plan, rank_loads
    if args.ranks < 1 or args.replicas < 0:
        raise ValueError(f"--ranks must be at least 1 and --replicas at least 0; got {args.ranks} and {args.replicas}")
    counts = read_counts(args.source)
    placement = plan(counts, args.ranks, args.replicas)
    for layer, per_expert in sorted(counts.items()):
        default = ExpertPlacement.contiguous(len(per_expert), args.ranks, [layer]).layers[layer]
        print(f"layer {layer}: rank imbalance {imbalance(rank_loads(per_expert, default)):.3f} contiguous -> "
              f"{imbalance(rank_loads(per_expert, placement.layers[layer])):.3f} planned", file=sys.stderr)
    if args.output is None:
        print(placement.to_json())
    else:
        Path(args.output).write_text(placement.to_json() + "\n")
    return 0
