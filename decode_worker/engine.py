"""The colocated engine: one instance that prefills and decodes (the baseline that
disaggregation is measured against), driven step by step."""
from __future__ import annotations

import logging
import time

from engine.block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus, SamplingParams
from engine.tokenizer import Tokenizer
from decode_worker.output import OutputProcessor, RequestOutput
from decode_worker.scheduler import Scheduler

logger = logging.getLogger(__name__)


class ColocatedEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        if tokenizer is None and runner is None:
            from engine.loader import resolve_model_path
            tokenizer = Tokenizer.from_path(resolve_model_path(config.model))
        self.tokenizer = tokenizer
        mc = self.runner.model_config
        block_size = self.runner.block_size
        # a sliding KV group frees the blocks its window left behind (KVCacheManager)
        self.kv = KVCacheManager(self.runner.num_blocks, block_size, config.cache.enable_prefix_caching,
                                 mc.kv_layout.windows)
        max_len = config.scheduler.max_model_len or mc.max_position_embeddings
        # a sequence can never need more blocks than the pool holds (block 0 is the null block)
        self.max_model_len = min(max_len, mc.max_position_embeddings, (self.runner.num_blocks - 1) * block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.output = OutputProcessor(tokenizer)
        # the config's and generation_config's EOS ids and the tokenizer's (Qwen: <|im_end|>, <|endoftext|>)
        ids = {*mc.eos_token_ids, mc.eos_token_id, tokenizer.eos_token_id if tokenizer else None}
        self.eos_token_ids = frozenset(ids - {None})

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        req = Request(request_id, list(prompt_token_ids), params, time.monotonic(), self.eos_token_ids)
        self.scheduler.add_request(req)
        self.output.add_request(req)
        return req

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.output.abort(request_id)

    def take_forks(self) -> list[tuple[str, list[Request]]]:
        """Requests forked into their n choices since the last call (the output processor now
        follows the choices); (parent id, choices)."""
        forks = self.scheduler.take_forks()
        for parent_id, children in forks:
            self.output.fork(parent_id, children)
        return forks

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty and self.scheduler.has_unfinished() and not self.scheduler.running:
            raise RuntimeError("no request can be scheduled: the KV pool is too small for the waiting prompt")
        result = self.runner.execute(sched)
        touched = self.scheduler.update(sched, result)
        self.take_forks()
        outputs, stopped = self.output.process(touched)
        for rid in stopped:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        return outputs
