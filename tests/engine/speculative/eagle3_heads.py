"""A plain torch reference of an EAGLE-3 head, written from the published checkpoints' layout
(dense causal attention, no cache); the heads themselves come from bench/eagle3_head.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ReferenceHead:
    """The head's forward over a whole sequence at once, in float64: drafts, and each draft's gap
    between its best two logits (to tell a near-tie from a wrong draft)."""

    def __init__(self, tensors: dict, config: dict, embed: torch.Tensor):
        self.t = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
        self.c, self.embed = config, embed.double()
        self.keys, self.values = [], []

    def _rms(self, x, name):
        return self.t[name] * F.rms_norm(x, (x.shape[-1],), eps=self.c["rms_norm_eps"])

    def _rope(self, x, pos):
        hd = x.shape[-1]
        inv = 1.0 / self.c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        f = pos[:, None].double() * inv
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + half * sin

    def step(self, ids: list[int], hidden: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, c, h = self.t, self.c, self.c["hidden_size"]
        hidden = hidden.double()
        if hidden.shape[-1] != h:
            hidden = hidden @ t["fc.weight"].T
        n, heads, kv = len(ids), c["num_attention_heads"], c["num_key_value_heads"]
        x = torch.cat([self._rms(self.embed[ids], "midlayer.input_layernorm.weight"),
                       self._rms(hidden, "midlayer.hidden_norm.weight")], -1)
        pos = torch.arange(first, first + n)
        q = self._rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, -1), pos)
        self.keys.append(self._rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, -1), pos))
        self.values.append((x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, -1))
        k, v = (torch.cat(a).repeat_interleave(heads // kv, dim=1) for a in (self.keys, self.values))
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        mask = torch.arange(k.shape[0])[None, :] > pos[:, None] - self.base  # keys from position `base` on
        o = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), v).reshape(n, -1)
        s = o @ t["midlayer.self_attn.o_proj.weight"].T + hidden
        y = self._rms(s, "midlayer.post_attention_layernorm.weight")
        pre = (F.silu(y @ t["midlayer.mlp.gate_proj.weight"].T) * (y @ t["midlayer.mlp.up_proj.weight"].T)) @ \
            t["midlayer.mlp.down_proj.weight"].T + s
        return self._rms(pre, "norm.weight"), pre

    def drafts(self, rows: torch.Tensor, tokens: list[int], k: int, base: int = 0) -> tuple[list[int], list[float]]:
        """rows: the target's, positions base .. m - 1; tokens: those at positions base + 1 .. m."""
        self.keys, self.values, self.base = [], [], base
        normed, pre = self.step(tokens, rows, base)
        normed, pre, first = normed[-1:], pre[-1:], base + len(tokens)
        out, gaps = [], []
        for _ in range(k):
            logits = normed @ self.t["lm_head.weight"].T
            top = logits[0].topk(2)
            d = int(top.indices[0])
            out.append(d + int(self.t["d2t"][d]))
            gaps.append(float(top.values[0] - top.values[1]))
            normed, pre = self.step([out[-1]], pre, first)
            first += 1
        return out, gaps
