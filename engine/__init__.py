"""The engine: one rank's model, KV cache and step, knowing nothing of roles, Ray, HTTP or Redis.

Its subpackages are floors, each importing only those below it (pyproject.toml's contract
"engine's floors import only the floors below them"; docs/architecture.md, "Floors inside engine/"):

    runner/       the model runner (one batch), its KV budget, CUDA graphs, the workers' run loop
    speculative/  proposers, their registry, verification (called by the runner through its __init__)
    sample/ text/ the sampler and structured output | tokenizer, chat template, detokenization
    loading/      a checkpoint's config and weights (HF folders, GGUF)
    models/       one module per model family, over the layers
    layers/       norms, rotary, the MoE block, MLA
    parallel/     the TP group, its layers and collectives, the step (ModelInput) and its channel
    attention/    attention backends
    quant/        linear methods and kernels, a GGUF's quantized codes
    core/         configuration and the shared records (requests, the step's in/out), the block manager
"""
