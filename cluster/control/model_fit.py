"""Refusing, before anything starts, a model a cluster spec cannot run: a config pdserve does not
run (engine/models refuses it) or a tensor-parallel size its heads or MLP do not split."""
from __future__ import annotations

from cluster.spec import ClusterSpec
from engine.loader import load_model_config


def check(spec: ClusterSpec) -> None:
    """Raises ValueError, in one line naming the flag, where a role's TP size cannot split the model."""
    config = load_model_config(spec.model)
    for role in spec.instance_counts:
        tp = spec.tp_size(role)
        if (why := config.tp_misfit(tp)) is not None:
            flag = "--prefill-tp" if role == "prefill" else "--decode-tp"
            raise ValueError(f"{flag} {tp} cannot run {config.name}: {why}")
