"""Qwen2, Gemma 2 and Mistral folders through `pdserve serve`'s app (1P1D, in-process) with the
official `openai` client: each family's chat template (Qwen2.5's ChatML without the tools
branch, Gemma's turns, Mistral's [INST]; kept beside this test) renders the prompt transformers
renders, the reply is transformers' greedy continuation, and generation stops on any id of
generation_config.json's EOS set.

The tokenizer is SmolLM2's (built from its GGUF: it has ChatML's <|im_start|> and <|im_end|>;
the other families' markers are plain text to it), saved into a tiny random model of the
family with the same vocabulary."""
from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from cluster.cli.serve import build, serve_in_thread
from cluster.spec import ClusterSpec
from engine.text.tokenizer import Tokenizer
from tests.helpers import hf_greedy, make_hf_tiny

pytestmark = pytest.mark.timeout(300)
FAMILIES = {"qwen2": ("qwen2", {}), "gemma2": ("gemma2", dict(head_dim=32, tie_word_embeddings=True)),
            "mistral": ("mistral", dict(sliding_window=24))}
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_folder(request, tmp_path_factory):
    """(folder, HF model, transformers' chat prompt ids, their greedy continuation ignoring EOS)."""
    from transformers import AutoTokenizer
    family, switches = FAMILIES[request.param]
    tok = Tokenizer.from_path("smollm2")
    folder = tmp_path_factory.mktemp(request.param) / request.param
    hf = make_hf_tiny(family, seed=3, vocab_size=tok.backend.get_vocab_size(), **switches)
    hf.save_pretrained(folder, safe_serialization=True)
    tok.backend.save(str(folder / "tokenizer.json"))
    template = Path(__file__).with_name(f"{request.param}_chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template}))
    ids = AutoTokenizer.from_pretrained(folder).apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return folder, hf, ids, hf_greedy(hf, ids, 8)


def _chat(folder: Path, max_tokens: int, **extra):
    spec = ClusterSpec(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16,
                       max_num_seqs=4, max_num_batched_tokens=256, num_threads=1, kv_transfer_timeout_s=30.0)
    cluster, app = build(spec, use_ray=False)
    url, stop = serve_in_thread(app)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        return client.chat.completions.create(model=str(folder), messages=MESSAGES, max_tokens=max_tokens,
                                              temperature=0, **extra)
    finally:
        stop()
        cluster.shutdown()


def test_chat_template_and_eos_set_through_serve(family_folder):
    folder, hf, ids, greedy = family_folder
    from transformers import AutoTokenizer
    ref_tok = AutoTokenizer.from_pretrained(folder)
    im_end, endoftext = ref_tok.convert_tokens_to_ids("<|im_end|>"), ref_tok.convert_tokens_to_ids("<|endoftext|>")
    # EOS: the tokenizer's <|im_end|>, and generation_config's list (Qwen's two, and the first
    # greedy token after the first that is new, which this random model does produce; the first
    # token itself where the model repeats one)
    stop_at = next((t for i, t in enumerate(greedy) if i and t not in greedy[:i]), greedy[0])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext, stop_at]}))
    reply = _chat(folder, 8)
    # the EOS token ends the output; a normal token's text stays in it (vLLM's rule: only special
    # tokens are skipped in the text)
    cut = greedy[:greedy.index(stop_at) + 1]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == ref_tok.decode(cut, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(cut) < 8
    # and without the extra EOS the same prompt runs to the length limit
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext]}))
    if im_end not in greedy and endoftext not in greedy:
        reply = _chat(folder, 8)
        assert reply.choices[0].finish_reason == "length"
        assert reply.choices[0].message.content == ref_tok.decode(greedy, skip_special_tokens=True)


SENTENCEPIECE_GGUF = Path(__file__).parents[1] / "engine" / "gguf" / "qwen2.gguf"


@pytest.mark.parametrize("with_template", [False, True])
def test_a_sentencepiece_gguf_without_a_chat_template_serves(with_template, tmp_path):
    """`pdserve serve` starts on a GGUF whose tokenizer is its own SentencePiece vocabulary and which
    carries no chat template: completions are served (the prompt tokenized as llama.cpp does, BOS
    first); chat is a 400 naming --chat-template, and works once one is given."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    model, tok = str(SENTENCEPIECE_GGUF), Tokenizer.from_path(SENTENCEPIECE_GGUF)
    spec = ClusterSpec(model=model, dtype="float32", device="cpu", num_kv_blocks=64, block_size=16, max_num_seqs=4,
                       max_num_batched_tokens=256, num_threads=1, kv_transfer_timeout_s=30.0,
                       chat_template=str(template) if with_template else None)
    cluster, app = build(spec, use_ray=False)
    url, stop = serve_in_thread(app)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(tok.encode("Hello")), 3)
        if not with_template:
            with pytest.raises(openai.BadRequestError, match="no chat template.*--chat-template"):
                client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
            return
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
        assert reply.usage.prompt_tokens == len(tok.encode(MESSAGES[0]["content"], add_special_tokens=False))
    finally:
        stop()
        cluster.shutdown()
