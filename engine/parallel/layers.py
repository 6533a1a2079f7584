"""Tensor-parallel layers. Collectives live here and nowhere else in the model.

At tp=1 every layer is a plain linear / embedding. Weights are sharded at load time by each
parameter's `weight_loader(param, full_weight[, shard_id])`, which receives the *full*
checkpoint tensor and copies this rank's slice into the parameter. How a linear stores and
multiplies its weight is its *linear method* (engine/quant): quantizing methods convert each
rank's shard after loading, so sharding is the same for every method.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.parallel.step import engine_types
from engine.parallel.tp_comm import broadcast_step
from engine.parallel.tp_wire import ControlChannel
from engine.quant.base import BaseLinearMethod, UnquantizedLinearMethod


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its instance's tensor-parallel group.

    Two process groups over the same ranks: `group` for the model's tensors (NCCL on GPUs, gloo on
    CPUs) and `control` (gloo) for what the driver tells its followers, where a follower may wait
    for long: an idle instance makes no collective call on the device group. Control messages are
    msgpack sealed with an HMAC under `key` (engine/parallel/tp_wire.py): nothing that arrives is unpickled,
    and a message from a process without the key is refused undecoded (TPAuthError)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup for tensors; None only when size == 1
    control: Any = None  # gloo ProcessGroup for objects; None: `group` (a CPU instance)
    device: torch.device = torch.device("cpu")  # where this rank's tensors live
    key: bytes = b""  # the control messages' MAC key, the same on every rank (b"": tests' hand-built groups)
    wire_types: tuple[type, ...] = ()  # records that may cross beyond the engine's (step.engine_types)
    channel: ControlChannel = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        assert 0 <= self.rank < self.size
        object.__setattr__(self, "channel", ControlChannel(self.key, self.rank, engine_types() + self.wire_types))

    def _need_group(self):
        if self.group is None:
            raise RuntimeError(f"tensor parallel size {self.size} needs a process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self._need_group()
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        self._need_group()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in rank order, on every rank."""
        if self.size == 1:
            return x
        self._need_group()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    @property
    def control_group(self):
        return self.group if self.control is None else self.control

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank, on the control channel (load-time choices)."""
        if self.size == 1:
            return obj
        self._need_group()
        return self.channel.broadcast(obj, dist.get_global_rank(self.group, 0), self.control_group)

    def broadcast_step(self, obj: Any = None) -> Any:
        """Rank 0's step on every rank: its structure on the control group, its tensors on
        `device` as one buffer per dtype on the device group (engine/parallel/tp_comm.py)."""
        if self.size == 1:
            return obj
        self._need_group()
        return broadcast_step(obj, self.rank, dist.get_global_rank(self.group, 0), self.channel, self.control_group,
                              self.group, self.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (on the control channel)."""
        if self.size == 1:
            return [obj]
        self._need_group()
        return self.channel.all_gather(obj, self.size, self.control_group)


class LinearBase(nn.Module):
    """A linear layer whose weight and matmul belong to its linear method (engine/quant): the
    method creates the parameters this layer's `weight_loader` fills with this rank's shard, and
    computes the product; the layer keeps the sharding and the collectives."""

    def __init__(self, input_size: int, output_size: int, linear_method: BaseLinearMethod | None = None):
        super().__init__()
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, input_size, output_size, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, *shard) -> None:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.linear_method.apply(self, x, bias)


def _divide(n: int, d: int) -> int:
    assert n % d == 0, f"{n} is not divisible by tensor parallel size {d}"
    return n // d


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's output rows split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = TPGroup(),
                 linear_method: BaseLinearMethod | None = None):
        self.tp = tp
        self.output_size_per_rank = _divide(output_size, tp.size)
        super().__init__(input_size, self.output_size_per_rank, linear_method)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        n = param.shape[0]
        param.data.copy_(full.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up_proj); each is split across ranks."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp: TPGroup = TPGroup(),
                 linear_method: BaseLinearMethod | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp, linear_method)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        n = _divide(self.output_sizes[shard_id], self.tp.size)
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, n).copy_(full.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. GQA-aware: KV heads are split across ranks, or,
    when tp > num_kv_heads, each rank holds one KV head shared by tp / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = TPGroup(), linear_method: BaseLinearMethod | None = None):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size)
        if tp.size >= num_kv_heads:
            _divide(tp.size, num_kv_heads)
            self.num_kv_heads, self.kv_replicas = 1, tp.size // num_kv_heads
        else:
            self.num_kv_heads, self.kv_replicas = _divide(num_kv_heads, tp.size), 1
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, output, bias, tp, linear_method)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.tp.rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, size).copy_(full.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's input columns split across ranks; partial sums all-reduced.
    The bias is added once, on rank 0, before the reduction.

    A method that `replicates_row_parallel` (the batch-invariant one) holds the whole W on every
    rank and gathers x's columns instead: each rank then sums in one rank's order, whatever the TP
    size (an all-reduce of partial sums rounds otherwise).

    reduce_results=False leaves the partial sum to the caller, who reduces it with others in one
    all-reduce (an MoE layer: its shared expert's and its routed experts' partial sums)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = TPGroup(),
                 linear_method: BaseLinearMethod | None = None, reduce_results: bool = True):
        self.tp, self.reduce_results = tp, reduce_results
        self.input_size_per_rank = _divide(input_size, tp.size)
        self.replicated = linear_method is not None and linear_method.replicates_row_parallel
        assert reduce_results or not self.replicated, "a replicated row-parallel layer has no partial sum to leave"
        super().__init__(input_size if self.replicated else self.input_size_per_rank, output_size, linear_method)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = lambda p, full: p.data.copy_(full)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if self.replicated:
            param.data.copy_(full)
            return
        n = param.shape[1]
        param.data.copy_(full.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replicated:
            return self._linear(self.tp.all_gather(x, dim=-1), self.bias)
        bias = self.bias if self.tp.rank == 0 else None
        out = self._linear(x, bias)
        return self.tp.all_reduce(out) if self.reduce_results else out


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks by vocabulary range; each rank embeds the ids it owns,
    zeros the rest, and an all-reduce sums the pieces."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.num_per_rank
        self.vocab_end = min(self.vocab_start + self.num_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(full[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        y = F.embedding((input_ids - self.vocab_start) * mask, self.weight)
        return self.tp.all_reduce(y * mask.unsqueeze(-1).to(y.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered to rank 0 (others get None).

    Unquantized (vLLM's default too), except that a Q4 GGUF's Q8_0 head may run from its own
    blocks (engine/quant/q8_head.py, set by the model runner before processing): its weight may be
    the embedding's (tied), and its logits feed sampling and logprobs directly. With tied weights
    the model swaps `weight` in after construction, so the method's `create_weights` is not used here."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup()):
        super().__init__(vocab_size, hidden_size, tp)
        self.linear_method = UnquantizedLinearMethod()

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.linear_method.apply(self, x, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self._linear(hidden, None)  # (num_tokens, num_per_rank)
        if self.tp.size == 1:
            return logits
        full = self.tp.gather(logits, dim=-1)
        return None if full is None else full[:, :self.vocab_size]
