"""DeepSeek-V3's MTP module through the colocated engine: every draft is the one transformers' own
decoder layer gives when run as the module (the reference below), greedy output equals plain
decoding, and a checkpoint without the module is refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.core.speculative_config import SpeculativeConfig
from tests.engine.speculative.test_eagle3 import assert_pool_whole
from tests.engine.speculative.test_engine import GREEDY, assert_same_greedy, make_engine, record_drafts, run
from tests.helpers import FAMILIES, make_hf_tiny

K = 2


def write_mtp_checkpoint(folder, seed: int, **overrides):
    """A tiny DeepSeek-V3 of 3 layers whose checkpoint carries one MTP module: layer 3 of a random
    4-layer model, with random enorm, hnorm and eh_proj, and its own embedding and shared head.
    `overrides` on tests.helpers' DeepSeek-V3 switches. (the 4-layer transformers model, the
    module's extra tensors)"""
    family, switches = FAMILIES["deepseek_v3"]
    hf = make_hf_tiny(family, seed=seed, **{**switches, **overrides, "num_hidden_layers": 4})
    hf.save_pretrained(folder, safe_serialization=True)
    g, h, vocab = torch.Generator().manual_seed(seed + 1), hf.config.hidden_size, hf.config.vocab_size
    extra = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 2.5 / (2 * h) ** 0.5,
             "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
             "embed_tokens.weight": torch.randn(vocab, h, generator=g),
             "shared_head.head.weight": torch.randn(vocab, h, generator=g) * 2.5 / h ** 0.5}
    (file,) = folder.glob("*.safetensors")
    save_file({**load_file(file), **{f"model.layers.3.{n}": t for n, t in extra.items()}}, file)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}))
    return hf.eval(), extra  # float32: transformers' grouped expert matmul takes no float64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, the 4-layer transformers model, the module's extra tensors)"""
    folder = tmp_path_factory.mktemp("mtp") / "v3"
    return (folder, *write_mtp_checkpoint(folder, seed=4))


def reference_drafts(hf, extra: dict, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
    """The module over the whole sequence at once, transformers' layer 3 as its decoder layer:
    fed the target's final hidden states at positions 0 .. m - 1 and the tokens at 1 .. m, then each
    draft with the module's own output before it. Drafts, and each one's gap between its best two logits."""
    eps = hf.config.rms_norm_eps

    def rms(x, name):
        return extra[name] * F.rms_norm(x, (x.shape[-1],), eps=eps)
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden, ids, out, gaps = hf.model.norm(states[3][0]), list(tokens[1:]), [], []
        for _ in range(k):
            n = len(ids)
            embeds = extra["embed_tokens.weight"][ids]
            embeds[0] = 0  # position 0
            x = torch.cat([rms(embeds, "enorm.weight"), rms(hidden, "hnorm.weight")], -1) @ extra["eh_proj.weight"].T
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
            pre = hf.model.layers[3](x[None], attention_mask=mask, position_ids=pos,
                                     position_embeddings=hf.model.rotary_emb(x[None], pos))[0]
            top = (rms(pre[-1], "shared_head.norm.weight") @ extra["shared_head.head.weight"].T).topk(2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids, hidden = ids + [out[-1]], torch.cat([hidden, pre[-1:]])
    return out, gaps


def test_mtp_drafts_are_the_reference_modules_and_the_output_exact(checkpoint):
    folder, hf, extra = checkpoint
    plain = run(make_engine(folder), GREEDY)
    engine = make_engine(folder, SpeculativeConfig("mtp", K, max_batch_size=64))
    seen = record_drafts(engine)
    assert_same_greedy(plain, run(engine, GREEDY))
    assert_pool_whole(engine)
    assert engine.speculator.proposed[0] > 20
    for tokens, drafts in seen:
        want, gaps = reference_drafts(hf, extra, tokens, len(drafts))
        for w, d, gap in zip(want, drafts, gaps):
            assert w == d or gap < 1e-3, (len(tokens), want, drafts, gaps)
            if w != d:
                break
    assert len(seen) > 40


def test_a_target_without_the_module_is_refused(tmp_path):
    from tests.helpers import save_tiny
    folder = save_tiny(tmp_path / "llama")
    with pytest.raises(ValueError, match="has no multi-token-prediction module"):
        make_engine(folder, SpeculativeConfig("mtp", K, max_batch_size=8))
