"""Gemma 3 beyond the per-family tests (logits and greedy tokens: tests/engine/models/test_families.py and
test_gguf_families.py): a config.json as published before transformers 5 reads as transformers
reads it; a `gemma3` GGUF gets llama.cpp's layer types, rotary bases and query scale; Gemma 3's
chat template renders through engine/text/tokenizer.py as transformers renders it."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from engine.loading.gguf_loader import _family_switches
from engine.models import config_from_hf
from engine.models.hf_config import normalize_rope_scaling
from engine.text.tokenizer import Tokenizer

# the keys of google/gemma-3-1b-it's config.json (transformers 4.50: no layer_types, no rope_parameters)
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
             "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
             "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
             "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
             "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
             "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
             "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
             "vocab_size": 262144}


@pytest.mark.parametrize("keys", [
    {},  # as published
    {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},  # 4B and up: the global layers' scaling
    {"rope_theta": None, "rope_local_base_freq": None, "sliding_window_pattern": None},  # the class's defaults
])
def test_older_configs_read_as_transformers_reads_them(keys):
    """Layer types from sliding_window_pattern (every 6th layer global), the global layers' rope_theta
    with rope_scaling, the sliding layers' rope_local_base_freq unscaled, the EOS list."""
    from transformers import Gemma3TextConfig
    cfg = {k: v for k, v in {**GEMMA3_1B, **keys}.items() if v is not None}
    ours, theirs = config_from_hf(cfg, "gemma-3-1b-it"), Gemma3TextConfig(**cfg)
    assert ours.architecture == "gemma3" and ours.eos_token_ids == (1, 106)
    assert [ours.window(i) for i in range(26)] == [512 if t == "sliding_attention" else None
                                                   for t in theirs.layer_types]
    assert [i for i in range(26) if ours.window(i) is None] == [5, 11, 17, 23]
    for kind, params in theirs.rope_parameters.items():
        assert ours.rope(kind) == (params["rope_theta"], normalize_rope_scaling(params)), kind
    assert ours.query_pre_attn_scalar == 256 and ours.final_logit_softcapping is None


def test_gguf_switches_follow_llama_cpp():
    """A `gemma3` file: with a window, every 6th layer global (or as sliding_window_pattern says),
    the sliding layers at rope.freq_base_swa (10000 when absent); without one, every layer global;
    queries scaled by head_dim, by hidden / heads for the 62-layer 27B."""
    def switches(num_layers=12, **meta):
        return _family_switches({f"gemma3.{k}": v for k, v in meta.items()}, "gemma3", num_layers, 5376, 32, 128)
    s = switches(**{"attention.sliding_window": 1024})
    assert [t[0] for t in s["layer_types"]] == list("sssssfsssssf") and s["sliding_window"] == 1024
    assert (s["sliding_rope_theta"], s["query_pre_attn_scalar"], s["qk_norm"]) == (10000.0, 128, True)
    assert switches(62, **{"attention.sliding_window": 1024})["query_pre_attn_scalar"] == 5376 // 32
    s = switches(4, **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False, True, True],
                       "rope.freq_base_swa": 5000.0, "final_logit_softcapping": 30.0})
    assert [t[0] for t in s["layer_types"]] == list("sfss") and s["sliding_rope_theta"] == 5000.0
    assert s["final_logit_softcapping"] == 30.0
    assert set(switches()["layer_types"]) == {"full_attention"}


# Gemma 3's chat template, verbatim: transformers' convert_gemma3_weights.py `_CHAT_TEMPLATE`, the one
# the published google/gemma-3-*-it tokenizer_config.json files carry
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
CHATS = {
    "user": ([{"role": "user", "content": " Hi! "}],
             "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n"),
    "system": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in 日本語"}],
               "<bos><start_of_turn>user\nBe terse.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\nBlue."
               "<end_of_turn>\n<start_of_turn>user\nAnother, in 日本語<end_of_turn>\n<start_of_turn>model\n"),
}


@pytest.fixture(scope="module")
def gemma3_tokenizer() -> Tokenizer:
    """Gemma 3's special tokens and chat template over a stand-in vocabulary (the template is the test)."""
    backend = BackendTokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<bos>": 2}, unk_token="<pad>"))
    return Tokenizer(backend, bos_token="<bos>", eos_token="<eos>", add_bos_token=True,
                     chat_template=GEMMA3_CHAT_TEMPLATE, name="gemma-3")


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_renders_as_transformers(gemma3_tokenizer, chat):
    """A system message folds into the first user turn; assistant turns are `model` turns."""
    from transformers.utils.chat_template_utils import render_jinja_template
    messages, want = CHATS[chat]
    theirs, _ = render_jinja_template(conversations=[messages], chat_template=GEMMA3_CHAT_TEMPLATE,
                                      add_generation_prompt=True, bos_token="<bos>", eos_token="<eos>")
    assert gemma3_tokenizer.apply_chat_template(messages) == theirs[0] == want
    no_prompt = gemma3_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == want.removesuffix("<start_of_turn>model\n")


def test_chat_template_refuses_roles_out_of_turn(gemma3_tokenizer):
    """Its raise_exception reaches the caller as a ValueError carrying the template's message."""
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        gemma3_tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
