"""The real server the gateway tests share (one per session: loading it takes seconds): uvicorn on
127.0.0.1, SmolLM2 (fp32) on one prefill and one decode instance in-process; and the colocated engine
its outputs are compared with. Both use the hermes chat template (tests/gateway/chat_templates: SmolLM2's
own renders no tools; the <|im_start|> tokens are the same), and the server reads tool calls with the
hermes parser and <think> with qwen3's (tests/gateway/test_openai_tools.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli.serve import build, serve_in_thread
from cluster.spec import ClusterSpec
from decode_worker.llm import LLM
from engine.loading.loader import resolve_model_path
from engine.text.tokenizer import Tokenizer
from tests.gateway.fakes import FakeCluster

HERMES = Path(__file__).parent / "chat_templates" / "hermes.jinja"


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer, for apps over a FakeCluster."""
    return Tokenizer.from_path(resolve_model_path("smollm2"))


@pytest.fixture
def cluster():
    return FakeCluster()


@pytest.fixture(scope="session")
def server():
    """(cluster, base URL of its OpenAI API)."""
    spec = ClusterSpec(model="smollm2", dtype="float32", device="cpu", num_kv_blocks=512, block_size=16,
                       max_num_seqs=128, max_num_batched_tokens=1024, num_threads=2, kv_transfer_timeout_s=30.0,
                       chat_template=str(HERMES), tool_call_parser="hermes", reasoning_parser="qwen3")
    cluster, app = build(spec, use_ray=False)
    url, stop = serve_in_thread(app)
    yield cluster, f"{url}/v1"
    stop()
    cluster.shutdown()


@pytest.fixture(scope="session")
def llm():
    engine = LLM(model="smollm2", dtype="float32", num_blocks=256)
    engine.tokenizer.set_chat_template(HERMES.read_text())
    return engine
