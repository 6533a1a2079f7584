"""What each instance role builds on a rank around its model runner: its KV transport ends (a
prefill's sender, and a receiver for the KV it fetches from other instances; a decode's receiver,
and a sender for what other instances fetch of its cache; a colocated instance has none) and its
worker.

RankHost (rank.py) builds the runner and the KV compat record the same way for every role, then asks
the role in ROLES for the rest: a role is one class here and one entry in ROLES, with no branch on
its name in the rank. Every role's worker is a BaseWorker (engine/runner/worker_base.py) over the
same runner; a decode or colocated one drives a ColocatedEngine (decode_worker/engine.py), a prefill
one its own prompt-only scheduler.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from decode_worker.engine import ColocatedEngine, DecodeWorker
from engine.attention import block_layout_of
from engine.core.config import EngineConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.worker_base import BaseWorker
from engine.text.tokenizer import Tokenizer
from kvtransfer.base import KVPool, KVReceiver, KVSender
from kvtransfer.connector import DecodeConnector, PrefillConnector
from kvtransfer.params import CompatRecord, kv_heads_of_rank
from kvtransfer.registry import create_kv_transport
from prefill_worker.worker import PrefillWorker


@dataclass(frozen=True)
class RankSetting:
    """What a role needs of its rank besides the runner (RankHost's arguments, resolved)."""

    config: EngineConfig
    instance_id: str
    rank: int
    tp_size: int
    host: str  # the address this rank's KV end binds
    kv_timeout_s: float
    kv_transport: str  # a name in kvtransfer/registry.py
    kv_same_device: bool  # KV written straight into a decode cache on the same device
    client_ttl_s: float
    text: bool  # rank 0 of a model by name: a decode loads its tokenizer (stop strings, text)


@dataclass(frozen=True)
class Built:
    worker: BaseWorker
    sender: KVSender | None = None
    receiver: KVReceiver | None = None


class Role(ABC):
    name: ClassVar[str]
    moves_kv: ClassVar[bool]  # whether KV transfers read or write this rank's cache

    @abstractmethod
    def build(self, runner: ModelRunner, compat: CompatRecord, kv_views, setting: RankSetting) -> Built:
        """The rank's KV end and worker over `runner`. `kv_views`: the attention backend's own
        block layout, which the transfer reads and writes through (None: torch's KV cache)."""


class Prefill(Role):
    name, moves_kv = "prefill", True

    def build(self, runner, compat, kv_views, setting) -> Built:
        mc = runner.model_config
        sender, connector = _sender(runner, compat, kv_views, setting)
        receiver = _receiver(runner, compat, kv_views, setting)
        fetcher = DecodeConnector(receiver, mc.num_kv_heads, setting.rank, setting.tp_size, mc.kv_layout.num_groups)
        return Built(PrefillWorker(runner, connector, setting.instance_id, client_ttl_s=setting.client_ttl_s,
                                   fetcher=fetcher, fetch_timeout_s=setting.kv_timeout_s),
                     sender=sender, receiver=receiver)


class Decode(Role):
    name, moves_kv = "decode", True

    def build(self, runner, compat, kv_views, setting) -> Built:
        receiver = _receiver(runner, compat, kv_views, setting)
        sender, holder = _sender(runner, compat, kv_views, setting)  # for what another instance fetches of its cache
        return Built(_decode_worker(runner, receiver, setting, holder), sender=sender, receiver=receiver)


class Colocated(Role):
    name, moves_kv = "colocated", False

    def build(self, runner, compat, kv_views, setting) -> Built:
        return Built(_decode_worker(runner, None, setting))


def _sender(runner: ModelRunner, compat: CompatRecord, kv_views, setting: RankSetting):
    """The rank's KV sender and the PrefillConnector over it: a request's blocks are leased to its
    transfer, freed on the receiver's ack, or after 3 transfer timeouts if no ack ever comes (a hung
    peer cannot pin them forever)."""
    mc = runner.model_config
    heads = kv_heads_of_rank(mc.num_kv_heads, setting.tp_size, setting.rank)
    sender = create_kv_transport(setting.kv_transport).sender(
        compat, f"{setting.instance_id}/{setting.rank}", timeout_s=setting.kv_timeout_s, host=setting.host,
        same_device=setting.kv_same_device, pool=KVPool(runner.kv_cache, block_layout_of(runner.backend), heads.start))
    return sender, PrefillConnector(sender, mc.num_kv_heads, setting.rank, setting.tp_size,
                                    lease_s=3 * setting.kv_timeout_s, kv_views=kv_views, kv_layout=mc.kv_layout)


def _receiver(runner: ModelRunner, compat: CompatRecord, kv_views, setting: RankSetting) -> KVReceiver:
    """The rank's KV receiver: its heads of the cache, bound to the rank's address."""
    heads = kv_heads_of_rank(runner.model_config.num_kv_heads, setting.tp_size, setting.rank)
    return create_kv_transport(setting.kv_transport).receiver(
        compat, runner.kv_cache, heads.start, host=setting.host, timeout_s=setting.kv_timeout_s,
        share_cache=setting.kv_same_device, kv_views=kv_views, layout=block_layout_of(runner.backend))


def _decode_worker(runner: ModelRunner, receiver: KVReceiver | None, setting: RankSetting,
                   holder: PrefillConnector | None = None) -> DecodeWorker:
    """A decode or colocated rank's worker: a ColocatedEngine over the runner (rank 0 of a named
    model with its tokenizer), taking remote KV through `receiver` (None: prompts prefilled here) and
    shipping what another instance fetches of its cache through `holder` (None: none)."""
    mc = runner.model_config
    tokenizer = Tokenizer.if_any(setting.config.model) if setting.text else None
    engine = ColocatedEngine(setting.config, runner=runner, tokenizer=tokenizer)
    connector = DecodeConnector(receiver, mc.num_kv_heads, setting.rank, setting.tp_size, mc.kv_layout.num_groups)
    return DecodeWorker(engine, connector, setting.instance_id, client_ttl_s=setting.client_ttl_s, holder=holder)


ROLES: dict[str, Role] = {role.name: role for role in (Prefill(), Decode(), Colocated())}
