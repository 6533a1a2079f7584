"""Text: the tokenizer and chat template (tokenizer.py; a GGUF's own vocabulary: gguf_tokenizer.py)
and incremental detokenization with stop strings (tokenizer.py: TextState).

May import: engine.loading and every floor below it.
"""
