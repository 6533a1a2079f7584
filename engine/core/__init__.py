"""The engine's lowest floor: configuration and the records every other floor shares.

config.py (EngineConfig, ModelConfig, CacheConfig, ...) and speculative_config.py (the speculative
knobs, checked before anything loads); request.py (SamplingParams, Request, RequestStatus;
SchedulerOutput in, RunnerOutput out: the step's interface; the Handover: what a prefill hands a
decode instance beside the KV); block_manager.py (the paged KV blocks, prefix caching); kv_cache.py (the pool's shape and bytes); expert_placement.py (which experts a
rank holds); choices.py (what rank 0 measures at load for its whole TP group); threads.py,
timing.py (small utilities).

May import: nothing of the engine above it (engine/ floors: docs/architecture.md).
"""
