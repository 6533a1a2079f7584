"""Speculative decoding's decode speed, offline: tokens/s with and without each method at batch 1
and 8, on a copying workload (repeat or edit a given text or code) and on free chat, the drafts
accepted per position, and where the per-batch decision turns speculation off.

    python -m bench.speculative                                  # none, ngram, draft_model; both workloads
    python -m bench.speculative --methods none ngram --batches 1 --max-tokens 64 --json
    python -m bench.speculative --neighbours 1                   # beside one busy process (a loaded host)
    python -m bench.speculative --methods none eagle3 --head random   # a head's cost (random: next to no draft kept)

The target is --model (SmolLM2-135M by default), greedy, in one colocated engine per method (model
load and the speculative profile not timed). The draft model (`--draft`) is a file or folder, or
`layers:N`: the target's first N decoder layers with its own norm and head, written to a temporary
folder (a draft of the target's vocabulary that costs about N/L of a target step; no smaller model
of SmolLM2's vocabulary is on this machine). The EAGLE-3 head (`--head`) is a folder, or `random`: a
random head over the target (bench/eagle3_head.py), which times what a head costs, not what a
trained one gains (none trained for SmolLM2 is on this machine). Batch 1 runs the workload's prompts one at a time;
batch 8 runs 8 at once. Decode tok/s: the tokens after each request's first over the time from the
first first-token to the last finish. The speculation limit is left to the engine (measured, over
batch sizes up to the largest --batches) unless --max-batch-size fixes it.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger("bench.speculative")

CODE = '''def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
'''
TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
        "the members agreed to increase funding for the library and to postpone the new parking garage "
        "until the spring. The chair thanked everyone for their patience and closed the meeting at six.")
COPYING = [f"Repeat the following code exactly:\n{CODE}",
           f"Rename the function merge_sorted to merge in this code and return the whole code:\n{CODE}",
           f"Repeat this paragraph word for word:\n{TEXT}",
           f"Rewrite this paragraph, replacing Tuesday with Friday and changing nothing else:\n{TEXT}"]
CHAT = ["What are three good habits for staying healthy?", "Explain how a bicycle stays upright.",
        "Write a short story about a lost cat.", "Why is the sky blue?"]
WORKLOADS = {"copying": COPYING, "chat": CHAT}


def write_layer_draft(model: str, num_layers: int, folder: Path) -> Path:
    """The target's first `num_layers` decoder layers, its final norm and head, as a HF folder."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from engine.loading.loader import load_model_config, load_weights, resolve_model_path
    path = resolve_model_path(model)
    mc = load_model_config(path)
    keep = {}
    for name, w in load_weights(path, torch.float32):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is None or int(layer) < num_layers:
            keep[name] = w.contiguous()
    cfg = LlamaConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=mc.num_heads,
                      num_key_value_heads=mc.num_kv_heads,
                      head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
                      max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
                      bos_token_id=mc.bos_token_id, eos_token_id=sorted(mc.eos_token_ids)[0])
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    save_file(keep, str(folder / "model.safetensors"))
    return folder


def decode_tok_s(outs) -> float:
    first = min(o.first_token_s for o in outs)
    last = max(o.finished_s for o in outs)
    return sum(len(o.token_ids) - 1 for o in outs) / max(last - first, 1e-9)


def measure(llm, prompts: list[str], batch: int, max_tokens: int) -> dict:
    from engine.core.request import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = [llm.generate(prompts[i:i + 1], params, chat=True) for i in range(len(prompts))] if batch == 1 else \
        [llm.generate([prompts[i % len(prompts)] for i in range(batch)], params, chat=True)]
    return {"decode_tok_s": sum(decode_tok_s(r) for r in runs) / len(runs),
            "tokens": sum(len(o.token_ids) for r in runs for o in r)}


def run_method(args, method: str, models: dict[str, str]) -> dict:
    """`models`: method -> its checkpoint (the draft, the head)."""
    from decode_worker.llm import LLM
    from engine.core.speculative_config import SpeculativeConfig
    spec = None if method == "none" else SpeculativeConfig(method, args.k, model=models.get(method),
                                                           max_batch_size=args.max_batch_size)
    llm = LLM(model=args.model, max_num_seqs=max(args.batches), speculative=spec, num_threads=args.threads,
              adapt_threads=True)  # as a served rank (cluster/control/rank_planner.py)
    llm.generate(["Hello"], None)  # warm-up, not counted
    out = {}
    for workload in args.workloads:
        for batch in args.batches:
            s = llm.engine.speculator
            before = (list(s.proposed), list(s.accepted)) if s else None
            row = measure(llm, WORKLOADS[workload], batch, args.max_tokens)
            if s is not None:
                proposed = [p - b for p, b in zip(s.proposed, before[0])]
                accepted = [a - b for a, b in zip(s.accepted, before[1])]
                row.update(proposed=proposed, accepted=accepted,
                           acceptance=[round(a / p, 3) if p else None for a, p in zip(accepted, proposed)],
                           max_batch_after=s.max_batch)
            out[f"{workload}/b{batch}"] = row
            logger.info("%s %s batch %d: %s", method, workload, batch, row)
    if llm.engine.speculator is not None and llm.engine.speculator.profile is not None:
        out["profile"] = llm.engine.speculator.profile.describe()
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "draft_model"],
                   choices=["none", "ngram", "draft_model", "eagle3"])
    p.add_argument("--head", default="random", help="the EAGLE-3 head: a folder, or random (bench/eagle3_head.py)")
    p.add_argument("--draft", default="layers:8", help="the draft model, layers:N (the target's first N layers) "
                                                       "or self (the target)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="--speculative-max-batch-size (default: measured; the profile spans up to the largest batch)")
    p.add_argument("--workloads", nargs="+", default=["copying", "chat"], choices=list(WORKLOADS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="--num-speculative-tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--neighbours", type=int, default=0, help="busy processes beside the engine (bench/busy_host.py)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    from bench.busy_host import busy_neighbours
    with tempfile.TemporaryDirectory() as tmp:
        draft = args.draft
        if draft == "self":
            draft = args.model
        elif "draft_model" in args.methods and draft.startswith("layers:"):
            draft = str(write_layer_draft(args.model, int(draft.split(":")[1]), Path(tmp) / "draft"))
        head = args.head
        if "eagle3" in args.methods and head == "random":
            from bench.eagle3_head import save_eagle3_head, target_hf_config
            head = str(save_eagle3_head(Path(tmp) / "head", target_hf_config(args.model), seed=0, draft_vocab=4096))
        result = {"machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                              "threads": torch.get_num_threads()},
                  "args": {k: v for k, v in vars(args).items() if k != "json"}, "methods": {}}
        with busy_neighbours(args.neighbours):
            start = time.monotonic()
            for method in args.methods:
                result["methods"][method] = run_method(args, method, {"draft_model": draft, "eagle3": head})
            result["seconds"] = round(time.monotonic() - start, 1)
    base = result["methods"].get("none")
    if base is not None:
        for method, rows in result["methods"].items():
            for key, row in rows.items():
                if isinstance(row, dict) and key in base:
                    row["over_none"] = round(row["decode_tok_s"] / base[key]["decode_tok_s"], 3)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
