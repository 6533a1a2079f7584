"""The engine's top floor: the model runner that executes one batch (model_runner.py), and what it
holds: the KV budget from device memory (kv_budget.py, device_memory.py), CUDA graphs
(cuda_graphs.py), the structured-output grammars of its requests (runner_grammars.py); and the base
of a worker that drives a runner and its TP followers (worker_base.py).

May import: every engine floor (engine.speculative through its package interface).
"""
