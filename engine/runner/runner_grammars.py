"""The structured-output grammars a model runner starts its requests with (engine/sample/structured_output.py
runs them): llguidance's tokenizer for the model, built for the first structured request, and each
new request's grammar state."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from engine.core.config import ModelConfig

if TYPE_CHECKING:  # llguidance is imported with the first structured request (not on every machine)
    import llguidance

    from engine.core.batch import NewRequestData
    from engine.sample.structured_output import GrammarState

logger = logging.getLogger(__name__)


class RunnerGrammars:
    def __init__(self, model: str, model_config: ModelConfig, device: torch.device):
        self.model, self.model_config, self.device = model, model_config, device
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def grammar_for(self, r: NewRequestData, old: GrammarState | None) -> GrammarState | None:
        """A new request's grammar state, fed the tokens it has output so far (a remote prefill's first
        token, a retry's); a resumed one (preempted: `old`, its state before) keeps its own."""
        if r.sampling_params.structured_output is None:
            return None
        output = r.history.output if r.history is not None else []
        if old is not None and old.num_tokens == len(output):
            return old
        from engine.sample.structured_output import GrammarState
        kind, spec = r.sampling_params.structured_output
        return GrammarState(kind, spec, self.tokenizer(), output, r.request_id)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer for this model (`engine.sample.structured_output.ll_tokenizer`), from the
        model's own tokenizer, over the logits' width, with the model's EOS ids; built once."""
        if self._ll_tokenizer is None:
            from engine.sample.structured_output import ll_tokenizer
            from engine.text.tokenizer import Tokenizer
            mc = self.model_config
            logger.info("structured output: first request; grammar tokenizer from %s, masks unpacked on %s",
                        self.model, "the CPU with numpy" if self.device.type == "cpu" else self.device)
            self._ll_tokenizer = ll_tokenizer(Tokenizer.from_path(self.model), mc.vocab_size,
                                              tuple(sorted(mc.eos_token_ids)))
        return self._ll_tokenizer
