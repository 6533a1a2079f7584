"""ClusterSpec: defaults, YAML, CLI flags and their precedence, validation, engine configs."""
from __future__ import annotations

import argparse
import ast
import re
import dataclasses
from pathlib import Path

import pytest
import yaml

from cluster.cli.flags import add_cli_flags
from cluster.spec import ClusterSpec
from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig

REPO = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    return parser.parse_args(argv)


def write_yaml(tmp_path: Path, data) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_defaults():
    """The defaults are one prefill + one decode instance of smollm2 at TP 1, memory state, port 8000."""
    spec = ClusterSpec()
    assert (spec.model, spec.dtype, spec.device, spec.mode) == ("smollm2", "auto", "auto", "disaggregated")
    assert (spec.num_prefill, spec.num_decode, spec.prefill_tp, spec.decode_tp) == (1, 1, 1, 1)
    assert (spec.redis_url, spec.ray_address, spec.host, spec.port) == (None, None, "127.0.0.1", 8000)
    assert (spec.block_size, spec.kv_memory_gib, spec.num_kv_blocks) == (16, 1.0, None)
    assert (spec.max_num_seqs, spec.max_num_batched_tokens, spec.enable_prefix_caching) == (128, 2048, True)
    assert (spec.attention_backend, spec.num_threads, spec.router_policy) == ("auto", None, "least_loaded")
    assert (spec.disagg_threshold_tokens, spec.kv_transfer_timeout_s, spec.heartbeat_ttl_s) == (0, 10.0, 5.0)
    assert (spec.api_key, spec.api_keys_file, spec.max_request_bytes, spec.max_prompt_tokens) == (
        None, None, 8 * 1024 * 1024, None)
    assert spec.instance_counts == {"prefill": 1, "decode": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.port = 1


def test_engine_config_per_role():
    """engine_config derives the engine's frozen configs; the TP size follows the role."""
    spec = ClusterSpec(prefill_tp=2, decode_tp=4, block_size=32, num_kv_blocks=500, kv_memory_gib=2,
                       max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False,
                       dtype="float32", device="cpu", attention_backend="torch", num_threads=2)
    prefill = spec.engine_config("prefill")
    assert isinstance(prefill, EngineConfig) and prefill.tp_size == 2
    assert spec.engine_config("decode").tp_size == 4 and spec.engine_config("colocated").tp_size == 4
    assert prefill.cache == CacheConfig(block_size=32, num_blocks=500, memory_gib=2.0, enable_prefix_caching=False)
    assert prefill.scheduler == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)
    assert (prefill.model, prefill.dtype, prefill.device, prefill.attention_backend, prefill.num_threads) == \
        ("smollm2", "float32", "cpu", "torch", 2)
    assert prefill.quantization == "auto"
    assert ClusterSpec(quantization="int8").engine_config("decode").quantization == "int8"
    with pytest.raises(ValueError, match="role"):
        spec.engine_config("router")


def test_role_gpu_memory_utilization_keys():
    """prefill_/decode_gpu_memory_utilization (flags too) replace gpu_memory_utilization in that
    role's engine config only; colocated instances take decode's; unset, every role has the spec's."""
    spec = ClusterSpec.from_args(parse(["--decode-gpu-memory-utilization", "0.5"]))
    assert spec.decode_gpu_memory_utilization == 0.5 and spec.prefill_gpu_memory_utilization is None
    assert spec.engine_config("decode").cache.gpu_memory_utilization == 0.5
    assert spec.engine_config("colocated").cache.gpu_memory_utilization == 0.5
    assert spec.engine_config("prefill").cache == spec.cache_config
    assert ClusterSpec(prefill_gpu_memory_utilization=1).engine_config("prefill").cache.gpu_memory_utilization == 1.0
    assert ClusterSpec().engine_config("decode").cache.gpu_memory_utilization == 0.9


def test_kv_cache_dtype_reaches_every_role():
    """kv_cache_dtype (flag, YAML key) is every role's CacheConfig.kv_cache_dtype; auto by default;
    argparse refuses other names."""
    assert ClusterSpec().cache_config.kv_cache_dtype == "auto"
    spec = ClusterSpec.from_args(parse(["--kv-cache-dtype", "fp8_e4m3"]))
    assert {spec.engine_config(r).cache.kv_cache_dtype for r in ("prefill", "decode", "colocated")} == {"fp8_e4m3"}
    with pytest.raises(SystemExit):
        parse(["--kv-cache-dtype", "int8"])


def test_kv_checksum_is_off_by_default_and_a_flag():
    """kv_checksum: off by default; --kv-checksum / --no-kv-checksum set it; a non-bool is refused."""
    assert ClusterSpec().kv_checksum is False
    assert ClusterSpec.from_args(parse(["--kv-checksum"])).kv_checksum is True
    assert ClusterSpec.from_args(parse(["--no-kv-checksum"])).kv_checksum is False
    with pytest.raises(ValueError, match="kv_checksum"):
        ClusterSpec(kv_checksum="yes")


def test_colocated_mode_counts():
    """Colocated mode runs num_decode colocated instances; num_prefill may be 0 there."""
    spec = ClusterSpec(mode="colocated", num_prefill=0, num_decode=3)
    assert spec.instance_counts == {"colocated": 3}


def test_from_yaml(tmp_path):
    """A YAML file sets any subset of keys; the rest keep their defaults; ints widen to floats."""
    spec = ClusterSpec.from_yaml(write_yaml(tmp_path, {"num_decode": 2, "kv_memory_gib": 2,
                                                       "redis_url": "redis://r:6379/0",
                                                       "enable_prefix_caching": False}))
    assert (spec.num_decode, spec.redis_url, spec.enable_prefix_caching) == (2, "redis://r:6379/0", False)
    assert spec.kv_memory_gib == 2.0 and isinstance(spec.kv_memory_gib, float)
    assert spec.num_prefill == 1 and spec.port == 8000
    assert ClusterSpec.from_yaml(write_yaml(tmp_path, "")) == ClusterSpec()


def test_yaml_round_trip(tmp_path):
    """to_dict dumped as YAML reads back as the same spec."""
    spec = ClusterSpec(num_decode=3, decode_tp=2, api_key="s3cret", num_kv_blocks=64, max_num_seqs=16)
    assert ClusterSpec.from_yaml(write_yaml(tmp_path, spec.to_dict())) == spec


def test_yaml_unknown_keys_are_named(tmp_path):
    """Unknown YAML keys raise ValueError naming every one of them."""
    path = write_yaml(tmp_path, {"num_decode": 2, "num_decoders": 3, "gpu_count": 1})
    with pytest.raises(ValueError, match="gpu_count, num_decoders"):
        ClusterSpec.from_yaml(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "port: [1\n"])
def test_yaml_not_a_mapping(tmp_path, text):
    """A YAML file that is not a mapping, or not YAML, raises ValueError."""
    with pytest.raises(ValueError):
        ClusterSpec.from_yaml(write_yaml(tmp_path, text))


def test_yaml_missing_file(tmp_path):
    """A missing spec file is a ValueError (a clear CLI message), not a traceback."""
    with pytest.raises(ValueError, match="cannot read"):
        ClusterSpec.from_yaml(tmp_path / "nope.yaml")


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    """Explicit flags beat the --config YAML, which beats the defaults; bools go both ways."""
    path = write_yaml(tmp_path, {"port": 9000, "num_decode": 3, "enable_prefix_caching": False, "dtype": "float32"})
    spec = ClusterSpec.from_args(parse(["--config", str(path), "--port", "9100", "--enable-prefix-caching"]))
    assert spec.port == 9100 and spec.enable_prefix_caching is True
    assert spec.num_decode == 3 and spec.dtype == "float32"
    assert spec.block_size == 16 and spec.host == "127.0.0.1"
    spec = ClusterSpec.from_args(parse(["--no-enable-prefix-caching", "--kv-memory-gib", "0.5",
                                        "--redis-url", "redis://h:1/2", "--num-kv-blocks", "100"]))
    assert (spec.enable_prefix_caching, spec.kv_memory_gib, spec.redis_url, spec.num_kv_blocks) == \
        (False, 0.5, "redis://h:1/2", 100)
    assert ClusterSpec.from_args(parse([])) == ClusterSpec()


def test_every_field_has_a_flag():
    """Each field is one --flag-name (dashes for underscores); bools also have --no-flag-name."""
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    options = {o for action in parser._actions for o in action.option_strings}
    assert "--config" in options
    for f in dataclasses.fields(ClusterSpec):
        assert "--" + f.name.replace("_", "-") in options
    assert "--no-enable-prefix-caching" in options


def test_cli_rejects_bad_values():
    """Choices fail in argparse; range errors fail in the spec with a ValueError."""
    with pytest.raises(SystemExit):
        parse(["--mode", "bogus"])
    with pytest.raises(SystemExit):
        parse(["--port", "eighty"])
    with pytest.raises(ValueError, match="num_decode"):
        ClusterSpec.from_args(parse(["--num-decode", "0"]))


@pytest.mark.parametrize("kw, message", [
    ({"num_decode": 0}, "num_decode"),
    ({"num_prefill": 0}, "num_prefill"),
    ({"prefill_tp": 0}, "prefill_tp"),
    ({"mode": "hybrid"}, "mode"),
    ({"dtype": "int8"}, "dtype"),
    ({"quantization": "int2"}, "quantization"),
    ({"device": "tpu"}, "device"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"router_policy": "best"}, "router_policy"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of auto, fp8_e4m3"),
    ({"port": 70000}, "port"),
    ({"port": -1}, "port"),
    ({"port": "8000"}, "port must be int"),
    ({"num_decode": True}, "num_decode must be int"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be bool"),
    ({"kv_memory_gib": 0}, "kv_memory_gib"),
    ({"block_size": 0}, "block_size"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"max_num_seqs": 256, "max_num_batched_tokens": 128}, "max_num_batched_tokens"),
    ({"heartbeat_ttl_s": 0}, "heartbeat_ttl_s"),
    ({"kv_transfer_timeout_s": -1.0}, "kv_transfer_timeout_s"),
    ({"disagg_threshold_tokens": -1}, "disagg_threshold_tokens"),
    ({"redis_url": "http://localhost:6379"}, "redis_url"),
    ({"model": ""}, "model"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"prefill_gpu_memory_utilization": 0.0}, "prefill_gpu_memory_utilization must be in"),
    ({"decode_gpu_memory_utilization": 1.5}, "decode_gpu_memory_utilization must be in"),
    ({"decode_gpu_memory_utilization": "half"}, "decode_gpu_memory_utilization must be float or null"),
    ({"tool_call_parser": "pythonic"}, "tool_call_parser must be one of hermes, llama3_json, mistral"),
    ({"reasoning_parser": "think"}, "reasoning_parser must be one of deepseek_r1, openai_gptoss, qwen3"),
    ({"chat_template": ""}, "chat_template must not be empty"),
    ({"api_keys_file": ""}, "api_keys_file must not be empty"),
    ({"max_request_bytes": 0}, "max_request_bytes must be >= 1, got 0"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens must be >= 1, got 0"),
    ({"max_instances": 1}, "max_instances must be >= 2, got 1"),  # (min_prefill + min_decode: one each)
    ({"autoscale_forecast": "arima"}, "autoscale_forecast"),
    ({"speculative_method": "medusa"}, "speculative_method must be one of ngram, draft_model"),
    ({"speculative_method": "draft_model"}, "draft_model needs --speculative-model"),
    ({"speculative_method": "eagle3"}, "eagle3 needs --speculative-model"),
    ({"speculative_method": "mtp", "speculative_model": "head"}, "speculative method mtp reads no model of its own"),
    ({"num_speculative_tokens": 2}, "--num-speculative-tokens needs --speculative-method"),
    ({"kv_disk_tier_gib": -1.0}, "kv_disk_tier_gib must be >= 0"),
    ({"kv_disk_tier_gib": 10.0}, "kv_disk_tier_gib 10 needs kv_host_tier_gib > 0"),
    ({"kv_disk_tier_dir": ""}, "kv_disk_tier_dir must not be empty"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 20}, "num_speculative_tokens must be in"),
])
def test_validation_errors(kw, message):
    """Bad values raise a ValueError that names the field."""
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**kw)


def test_api_key_not_in_repr():
    """The API key is a secret: it never shows up in a repr (and so in logs)."""
    assert "s3cret" not in repr(ClusterSpec(api_key="s3cret"))


@pytest.mark.parametrize("module, allowed", [("cluster/spec.py", {"engine.attention", "engine.core.config",
                                                                   "engine.core.expert_placement", "engine.core.tracing"}),
                                             ("cluster/state.py", set()), ("engine/core/tracing.py", set()),
                                             ("cluster/state_factory.py", {"cluster.state", "cluster.redis_state",
                                                                           "cluster.redis_client"}),
                                             ("cluster/redis_state.py", {"cluster.state", "cluster.redis_client"}),
                                             ("cluster/redis_client.py", set())])
def test_leaf_modules_import_nothing_of_ours(module, allowed):
    """cluster/spec.py and the cluster state are leaves: spec imports only engine (its configs, the
    attention backends' names, tracing's config); engine's tracing nothing of ours; the state's interface imports
    nothing of ours, its Redis backend the
    interface and the Redis client, its factory both backends and the client (for a masked URL);
    the client imports nothing of ours."""
    ours = {"engine", "prefill_worker", "decode_worker", "kvtransfer", "router", "gateway", "cluster", "bench"}
    tree = ast.parse((REPO / module).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m for m in imported if m.split(".")[0] in ours} == allowed


def test_chat_template_must_be_a_file_with_a_template(tmp_path):
    from cluster.cli.serve import gateway_tokenizer
    with pytest.raises(ValueError, match="chat_template .* is not a file"):
        gateway_tokenizer(ClusterSpec(chat_template=str(tmp_path / "none.jinja")))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="bad.jinja"):
        gateway_tokenizer(ClusterSpec(chat_template=str(bad)))
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}")
    tokenizer = gateway_tokenizer(ClusterSpec(chat_template=str(good)))
    assert tokenizer.supports_tools and tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize("values, says", [({"otlp_traces_endpoint": "collector:4318"}, "must be an http(s) URL"),
                                          ({"otlp_traces_endpoint": ""}, "must not be empty"),
                                          ({"trace_sample_ratio": 0.0}, "trace_sample_ratio must be in (0, 1]"),
                                          ({"trace_sample_ratio": 1.5}, "trace_sample_ratio must be in (0, 1]")])
def test_tracing_values_that_cannot_work_are_refused(values, says):
    """An OTLP endpoint that is no http(s) URL, or a sampling ratio outside (0, 1], is refused in one line."""
    with pytest.raises(ValueError, match=re.escape(says)):
        ClusterSpec(**values)


def test_the_tracing_config_adds_the_otlp_path_only_to_a_bare_endpoint():
    """As OTEL_EXPORTER_OTLP_ENDPOINT: a bare endpoint gets /v1/traces; one with a path is used as given."""
    bare = ClusterSpec(otlp_traces_endpoint="http://collector:4318")
    assert bare.tracing.traces_url == "http://collector:4318/v1/traces"
    assert ClusterSpec(otlp_traces_endpoint="https://c/otlp/v1/traces").tracing.traces_url == "https://c/otlp/v1/traces"
    assert ClusterSpec().tracing is None
