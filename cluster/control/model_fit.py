"""Refusing, before anything starts, a model a cluster spec cannot run: a config pdserve does not
run (engine/models refuses it), a tensor-parallel size its heads, MLP or experts do not split,
expert parallelism for a model without experts, or an expert placement that does not fit it."""
from __future__ import annotations

from cluster.spec import ClusterSpec
from engine.loading.loader import load_model_config


def check(spec: ClusterSpec) -> None:
    """Raises ValueError, in one line naming the flag, where a role's TP size cannot split the model,
    its expert parallelism or expert placement cannot run it."""
    config = load_model_config(spec.model)
    for role in spec.instance_counts:
        tp, expert_parallel = spec.tp_size(role), spec.expert_parallel(role)
        if expert_parallel and config.moe is None:
            side = "prefill" if role == "prefill" else "decode"
            own = getattr(spec, f"{side}_expert_parallel")
            flag = "--enable-expert-parallel" if own is None else f"--{side}-expert-parallel"
            raise ValueError(f"{flag}: {config.name} has no experts to partition")
        if (why := config.tp_misfit(tp, expert_parallel)) is not None:
            flag = "--prefill-tp" if role == "prefill" else "--decode-tp"
            ep = " with expert parallelism" if expert_parallel else ""
            raise ValueError(f"{flag} {tp}{ep} cannot run {config.name}: {why}")
        if (placement := spec.placement_for(role)) is not None:
            if (why := placement.misfit(config.moe.num_experts, config.sparse_layers, tp)) is not None:
                raise ValueError(f"--expert-placement {spec.expert_placement} cannot run {config.name} on a {role} "
                                 f"instance: {why}")
    if spec.expert_placement is not None and not any(spec.expert_parallel(r) for r in spec.instance_counts):
        raise ValueError(f"--expert-placement {spec.expert_placement}: no instance is expert-parallel "
                         "(add --enable-expert-parallel)")
