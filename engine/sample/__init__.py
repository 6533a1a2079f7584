"""Picking tokens from logits: the sampling controls applied to the logits (sampling.py),
the sampler (sampling.py: temperature, top-k/p, min-p, logprobs) and structured output
(structured_output.py: llguidance grammars and their token masks).

May import: engine.core only.
"""
