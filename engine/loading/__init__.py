"""Reading a checkpoint: loader.py (a model name or path -> its ModelConfig and weights under HF
names, for a Hugging Face folder or a GGUF file) and gguf_loader.py (a GGUF's config and its
floats, converted once and cached; its 4-bit codes are engine/quant/gguf_codes.py's).

May import: engine.models and every floor below it.
"""
