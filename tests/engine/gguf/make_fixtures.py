"""Writes this folder's GGUF test files with llama.cpp's own converter (run by hand; the files are
committed, so `make test` needs neither the converter nor sentencepiece).

    pip install sentencepiece
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d DIR   # its sdist
    tar xzf DIR/llama_cpp_python-0.3.36.tar.gz -C DIR
    python -m tests.engine.gguf.make_fixtures DIR/llama_cpp_python-0.3.36/vendor/llama.cpp

For each family, a tiny random transformers model (tests/helpers.py `make_hf_tiny`, its
published switches) with a 512-token SentencePiece vocabulary trained on this repository's docs
(the converter reads tokenizer.model; the GPT-2 kind needs a pre-tokenizer it knows), converted
`--outtype f32` to `<family>.gguf`. The tests compare pdserve's load of each file with
transformers' own GGUF loader (`from_pretrained(gguf_file=...)`).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
VOCAB = 512
FAMILIES = {  # name -> (family, switches): what each GGUF architecture carries
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    # query_pre_attn_scalar = head_dim: a GGUF has no key for it (llama.cpp assumes head_dim); tied, as
    # Gemma 2 is (its converter drops lm_head.weight)
    "gemma2": ("gemma2", dict(head_dim=32, sliding_window=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, query_pre_attn_scalar=32, tie_word_embeddings=True)),
}


def train_tokenizer(folder: Path) -> None:
    import sentencepiece as spm
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    corpus = folder / "corpus.txt"
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=VOCAB,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.99, bos_id=1, eos_id=2,
                                   unk_id=0, pad_id=-1, num_threads=1, minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()


def main(llama_cpp: str) -> int:
    from tests.helpers import make_hf_tiny
    for name, (family, switches) in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / name
            make_hf_tiny(family, seed=len(name), vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                         **switches).save_pretrained(folder, safe_serialization=True)
            train_tokenizer(folder)
            out = HERE / f"{name}.gguf"
            subprocess.run([sys.executable, str(Path(llama_cpp) / "convert_hf_to_gguf.py"), str(folder),
                            "--outtype", "f32", "--outfile", str(out)], check=True)
            print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
