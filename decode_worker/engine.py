"""The colocated engine: one instance that prefills and decodes (the baseline that
disaggregation is measured against), driven step by step."""
from __future__ import annotations

import logging
import time

from engine.core.block_manager import KVCacheManager
from engine.core.config import EngineConfig
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.runner.host_arena import attach_tier
from engine.runner.model_runner import ModelRunner
from engine.speculative.speculator import Speculator
from engine.text.tokenizer import Tokenizer
from decode_worker.output import OutputProcessor, RequestOutput
from decode_worker.scheduler import Scheduler

logger = logging.getLogger(__name__)


class ColocatedEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None):
        self.config = config
        self.runner = runner or ModelRunner(config)
        if tokenizer is None and runner is None:
            tokenizer = Tokenizer.from_path(config.model)
        self.tokenizer = tokenizer
        mc = self.runner.model_config
        block_size = self.runner.block_size
        # a sliding KV group frees the blocks its window left behind (KVCacheManager)
        self.kv = attach_tier(KVCacheManager(self.runner.num_blocks, block_size, config.cache.enable_prefix_caching,
                                             mc.kv_layout.windows), self.runner)
        self.max_model_len = self.runner.max_model_len
        # rank 0's: the draft runs there alone (the other ranks' runners took part in the profile)
        self.speculator = None if config.speculative is None or self.runner.tp.rank > 0 else \
            Speculator.build(config.speculative, self.runner)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.speculator,
                                   kv_delta=config.cache.kv_delta)
        self.output = OutputProcessor()  # token ids only: text is the front end's (engine/text/detokenize.py)
        self.eos_token_ids = frozenset(mc.eos_token_ids)  # the model's one EOS set (ModelConfig)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        req = Request(request_id, list(prompt_token_ids), params, time.monotonic(), self.eos_token_ids)
        self.scheduler.add_request(req)
        self.output.add_request(request_id)
        return req

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Ends a request here (`status` FINISHED_STOPPED: its front end found a stop string)."""
        self.scheduler.finish_request(request_id, status)
        self.output.abort(request_id)

    def take_forks(self) -> list[tuple[str, list[Request]]]:
        """Requests forked into their n choices since the last call (the outputs now follow the
        choices); (parent id, choices)."""
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
        return self.output.process(touched)
