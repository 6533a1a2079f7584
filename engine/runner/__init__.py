"""The engine's top floor: the model runner that executes one batch (model_runner.py, with the
structured-output grammars of its requests), and what it holds: its model, built at start
(model_loading.py), the KV budget from device memory (kv_budget.py, device_memory.py), CUDA graphs
(cuda_graphs.py), the host KV tier's arena (host_arena.py); and the base of a worker that drives a
runner and its TP followers, with its per-client outbox (worker_base.py).

May import: every engine floor (engine.speculative through its package interface).
"""
