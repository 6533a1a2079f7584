"""Writes this folder's GGUF test files with llama.cpp's own converter (run by hand; the files are
committed, so `make test` needs neither the converter nor sentencepiece).

    pip install sentencepiece
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d DIR   # its sdist
    tar xzf DIR/llama_cpp_python-0.3.36.tar.gz -C DIR
    python -m tests.engine.gguf.make_fixtures DIR/llama_cpp_python-0.3.36/vendor/llama.cpp [NAME ...]

(NAME: only those files, e.g. qwen3_moe; default all.)

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
    # six layers of the pattern llama.cpp assumes (every 6th global: the converter writes no layer
    # types), query_pre_attn_scalar = head_dim as for Gemma 2; the global layers' linear rope scaling
    # and the sliding ones' base travel as rope.scaling.* and rope.freq_base_swa, the logit cap too
    "gemma3": ("gemma3", dict(head_dim=32, num_hidden_layers=6, sliding_window=24, query_pre_attn_scalar=32,
                              final_logit_softcapping=3.0, tie_word_embeddings=True,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1000000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # mixtures (issue 32), as tests/helpers.py FAMILIES has them, less what llama.cpp does not carry:
    # Mixtral converts as `llama` with experts (its window dropped, as Mistral's); its converter
    # maps no dense layer of a Qwen-MoE (every layer sparse here); llama.cpp renormalizes
    # Qwen3-MoE's top-k and not Qwen2-MoE's, whatever norm_topk_prob says
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=32)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=96, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                    norm_topk_prob=True)),
}


# The converter, run as its own script would be, but for one change: its Qwen-MoE classes read the
# vocabulary as Qwen2's do (SentencePiece when there is a tokenizer.model), not only through a HF
# tokenizer of a pre-tokenizer it knows, which these tiny models lack. Tensors and metadata are its own.
CONVERT = """
import runpy, sys
from pathlib import Path
root = sys.argv.pop(1)
sys.path.insert(0, root)
from conversion import qwen
qwen.Qwen2MoeModel.set_vocab = qwen.Qwen2Model.set_vocab
sys.argv[0] = str(Path(root) / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


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


def main(llama_cpp: str, names: list[str]) -> int:
    from tests.helpers import make_hf_tiny
    for name, (family, switches) in FAMILIES.items():
        if names and name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / name
            make_hf_tiny(family, seed=len(name), vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                         **switches).save_pretrained(folder, safe_serialization=True)
            train_tokenizer(folder)
            out = HERE / f"{name}.gguf"
            subprocess.run([sys.executable, "-c", CONVERT, llama_cpp, str(folder), "--outtype", "f32", "--outfile",
                            str(out)], check=True)
            print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
