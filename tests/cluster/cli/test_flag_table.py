"""One table of the spec's flags (cluster/cli/flags.py FLAG_GROUPS): `serve`, `generate` and the spec's
YAML keys each take every engine, KV-transfer and layout entry; the service entries are serve's only.
Parse only: nothing here starts a server, a cluster or an engine."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import yaml

from cluster.cli import cli
from cluster.cli.cli import _cluster_spec, _generate_spec, build_parser, main
from cluster.cli.flags import FLAG_GROUPS, GENERATE_GROUPS
from cluster.spec import CHOICES, ClusterSpec, key_type

DEFAULT = ClusterSpec()
# values that a key's type alone does not give: a device and a state URL are patterns, not any string
VALUES = {"device": "cpu", "redis_url": "redis://127.0.0.1:6379/0", "otlp_traces_endpoint": "http://127.0.0.1:4318"}
# keys that a spec refuses alone (SpeculativeConfig.from_flags: the knobs need a method; the disk tier
# sits under the host tier)
NEEDS = {"num_speculative_tokens": {"speculative_method": "ngram"},
         "speculative_max_batch_size": {"speculative_method": "ngram"},
         "kv_disk_tier_gib": {"kv_host_tier_gib": 1.0}}


def sample(key: str):
    """A valid value of `key` other than its default, from its choices or its type."""
    default = getattr(DEFAULT, key)
    if key in VALUES:
        return VALUES[key]
    if key in CHOICES:
        return next(c for c in CHOICES[key] if c != default)
    kind = key_type(key)
    if kind is bool:
        return not default
    if kind is int:
        return (default or 1) + 1
    if kind is float:
        return default / 2 if default else 0.5
    return f"{key}.file"


def argv(values: dict) -> list[str]:
    """`--flag value` per key (`--x` / `--no-x` for bools)."""
    out = []
    for key, value in values.items():
        flag = key.replace("_", "-")
        out += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return out


def entries(groups) -> list[tuple[str, str]]:
    return [(group, key) for group in groups for key in FLAG_GROUPS[group]]


def test_every_spec_key_is_in_exactly_one_group():
    """The table names spec keys only, each once, and all of them: a new key lands in one group."""
    named = [key for keys in FLAG_GROUPS.values() for key in keys]
    assert sorted(named) == sorted(f.name for f in dataclasses.fields(ClusterSpec))
    assert set(GENERATE_GROUPS) == {"engine", "kv_transfer", "layout"}


def test_the_flags_generate_lacked_are_its_flags():
    """The serve flags issue 49 found `pdserve generate` refusing as unknown arguments are generate's now."""
    lacked = ["--attention-backend", "--kv-checksum", "--kv-transport", "--block-size", "--device",
              "--enable-prefix-caching", "--enforce-eager", "--max-num-seqs", "--max-num-batched-tokens",
              "--num-kv-blocks", "--kv-memory-gib", "--gpu-memory-utilization", "--enable-expert-parallel",
              "--prefill-expert-parallel", "--decode-expert-parallel", "--expert-placement", "--expert-method",
              "--decode-tp", "--config"]
    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    generate = {option for action in subparsers["generate"]._actions for option in action.option_strings}
    assert [flag for flag in lacked if flag not in generate] == []


@pytest.mark.parametrize("group, key", entries(GENERATE_GROUPS))
def test_serve_generate_and_the_spec_take_each_entry(group, key, tmp_path):
    """Each engine, KV-transfer and layout key: a flag of `serve` and of `generate` and a YAML key, all three
    reaching the spec with the value given. Engine keys keep generate in process; the others ask for a cluster."""
    values = {**NEEDS.get(key, {}), key: sample(key)}
    serve = ClusterSpec.from_args(build_parser().parse_args(["serve", *argv(values)]))
    args = build_parser().parse_args(["generate", "hi", *argv(values)])
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(values))
    for spec in (serve, _generate_spec(args), ClusterSpec.from_yaml(path)):
        assert getattr(spec, key) == values[key] != getattr(DEFAULT, key)
    assert (_cluster_spec(args) is None) == (group == "engine")


@pytest.mark.parametrize("key", FLAG_GROUPS["service"])
def test_service_entries_are_serve_flags_that_generate_refuses(key, capsys):
    """A gateway, state, health, autoscaling or Kubernetes key is a flag of `serve`; `generate` refuses
    it as an unknown argument, by name (it runs its own cluster for one prompt)."""
    values = {key: sample(key)}
    assert getattr(ClusterSpec.from_args(build_parser().parse_args(["serve", *argv(values)])), key) == values[key]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "hi", *argv(values)])
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {argv(values)[0]}" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--attention-backend", "nope"], ["--attention-back", "flex"], ["--bogus"]])
def test_generate_refuses_bad_flags_in_one_line(extra, capsys):
    """A bad value, a prefix of a flag (no abbreviations) or an unknown flag: one error line naming it."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", *extra])
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and extra[0] in error[0], error


def test_generate_shorthands_and_tp():
    """generate's own spellings: --prefill / --decode / --threads for the spec's keys, --tp for both pools
    unless --decode-tp / --prefill-tp say otherwise."""
    spec = _cluster_spec(build_parser().parse_args(["generate", "hi", "--prefill", "2", "--decode", "3",
                                                    "--threads", "4", "--tp", "3", "--decode-tp", "1"]))
    assert (spec.num_prefill, spec.num_decode, spec.num_threads, spec.prefill_tp, spec.decode_tp) == (2, 3, 4, 3, 1)


def test_generate_honours_engine_flags_in_process(monkeypatch, capsys):
    """`pdserve generate --attention-backend flex ...` (refused before issue 49) builds its one engine from
    them: the engine config the colocated engine gets carries every flag given."""
    seen = {}

    class Engine:
        def __init__(self, config):
            seen["config"] = config

    class Output:
        text, token_ids, prompt_token_ids, finish_reason, ttft_s, tokens_per_s = "ok", [1], [2], "length", 0.1, 1.0

    class LLM:
        def __init__(self, engine):
            self.engine = engine

        def generate(self, prompts, params, chat):
            return [Output()]

    monkeypatch.setattr("decode_worker.engine.ColocatedEngine", Engine)
    monkeypatch.setattr("decode_worker.llm.LLM", LLM)
    assert main(["generate", "hi", "--attention-backend", "flex", "--block-size", "32", "--device", "cpu",
                 "--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager", "--num-kv-blocks", "64"]) == 0
    config = seen["config"]
    assert (config.attention_backend, config.device, config.enforce_eager) == ("flex", "cpu", True)
    assert (config.cache.block_size, config.cache.num_blocks, config.cache.enable_prefix_caching) == (32, 64, False)
    assert config.scheduler.max_num_seqs == 8 and capsys.readouterr().out == "ok\n"


def test_generate_runs_kv_and_layout_flags_on_a_cluster(monkeypatch, tmp_path, caplog):
    """KV-transfer and layout flags, and --config, run the prompt on a cluster of that spec; a config's
    service keys (where a running cluster lives, its gateway) are dropped, named in a warning."""
    seen = []
    monkeypatch.setattr(cli, "_generate_on_cluster", lambda spec, args, params: seen.append(spec) or {"text": ""})
    assert main(["generate", "hi", "--kv-transport", "torch", "--kv-checksum", "--decode-tp", "2"]) == 0
    assert (seen[0].kv_transport, seen[0].kv_checksum, seen[0].decode_tp, seen[0].prefill_tp) == ("torch", True, 2, 1)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"num_decode": 2, "ray_address": "10.0.0.1:6379", "port": 9000}))
    with caplog.at_level(logging.WARNING, logger="cluster.cli.cli"):
        assert main(["generate", "hi", "--config", str(path)]) == 0
    assert (seen[1].num_decode, seen[1].ray_address, seen[1].port) == (2, None, DEFAULT.port)
    assert "ray_address, port" in caplog.text
