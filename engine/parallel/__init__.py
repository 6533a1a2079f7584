"""Tensor parallelism: the TP group and its layers (layers.py: TPGroup, Column/Row/QKV parallel
linears, VocabParallelEmbedding, the LM head; the only place collectives run), the step every rank
runs (step.py: ModelInput), and its control channel (tp_wire.py: authenticated msgpack; tp_comm.py:
the step's broadcast).

May import: engine.attention, engine.quant, engine.core.
"""
