"""Schemathesis against the real thing: `pdserve serve`'s app (uvicorn, 1P1D in-process) over a
tiny random Llama with SmolLM2's tokenizer and a 96-token context (generations stay short), read
from the server's own /openapi.json. Every conformance check, as over the fake cluster
(tests/gateway/test_schemathesis.py), now with generation really running."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.serve import build, serve_in_thread
from cluster.spec import ClusterSpec
from engine.text.tokenizer import Tokenizer
from tests.helpers import make_hf_tiny

pytestmark = pytest.mark.timeout(600)


CONFIG_TOML = """
[output.sanitization]
enabled = false

[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The served URL, over a tiny Llama with SmolLM2's tokenizer and a ChatML template."""
    tok = Tokenizer.from_path("smollm2")
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_tiny("llama", seed=0, vocab_size=tok.backend.get_vocab_size(),
                 max_position_embeddings=96).save_pretrained(folder, safe_serialization=True)
    tok.backend.save(str(folder / "tokenizer.json"))
    template = Path(__file__).with_name("qwen2_chat_template.jinja").read_text()  # ChatML
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": template}))
    spec = ClusterSpec(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16,
                       max_num_seqs=8, max_num_batched_tokens=256, num_threads=1, kv_transfer_timeout_s=30.0)
    cluster, app = build(spec, use_ray=False)
    url, stop = serve_in_thread(app)
    yield cluster, url
    stop()
    cluster.shutdown()


def test_schemathesis_coverage_and_fuzzing_with_every_check(server, tmp_path):
    """`schemathesis run` (its CLI, as a user runs it): the coverage phase (boundary and
    invalid values of every field) and the fuzzing phase, positive and negative cases, every check;
    exit 0 means no failure. The generation endpoints answered 200 to some of them (real
    generation ran, not only refusals)."""
    cluster, url = server
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG_TOML)
    before = _generated(cluster)
    run = subprocess.run([str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config), "run",
                          f"{url}/openapi.json", "--phases", "coverage,fuzzing", "--checks", "all", "--mode", "all",
                          "--max-examples", "30", "--workers", "1", "--no-color"],
                         capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert _generated(cluster) > before, run.stdout[-3000:]
    cluster.assert_no_leaks()


def _generated(cluster) -> int:
    """Prompts whose KV crossed from the prefill to the decode instance so far."""
    return cluster.instances["decode-0"].ranks[0].receiver.stats.get("completed", 0)
