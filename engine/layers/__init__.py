"""The model's building blocks over the TP layers: common.py (RMSNorm, rotary embeddings, SwiGLU),
the mixture of experts (moe.py: the sparse block; routing.py: top-k; expert_compute.py,
fused_experts.py, quant_experts.py: how the experts' GEMMs run) and latent attention (mla.py).

May import: engine.parallel, engine.attention, engine.quant, engine.core.
"""
