"""`pdserve generate` with cluster flags runs through Ray actors and prints the same JSON."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from cluster.cli.cli import _cluster_spec, _generate_spec, build_parser


def test_cluster_flags_build_the_spec():
    """No cluster flag: in-process engine. --tp sets both pools unless --prefill-tp overrides."""
    parse = lambda *a: build_parser().parse_args(["generate", "hi", *a])  # noqa: E731
    assert _cluster_spec(parse()) is None
    spec = _cluster_spec(parse("--prefill", "2", "--decode", "3", "--tp", "3", "--prefill-tp", "1"))
    assert (spec.num_prefill, spec.num_decode, spec.prefill_tp, spec.decode_tp, spec.mode) == (2, 3, 1, 3,
                                                                                               "disaggregated")
    assert _cluster_spec(parse("--mode", "colocated")).instance_counts == {"colocated": 1}


def test_generate_kv_cache_dtype_flag():
    """`pdserve generate --kv-cache-dtype` offers the engine's choices and reaches the cluster spec."""
    from engine.core.config import KV_CACHE_DTYPE_CHOICES
    parse = lambda *a: build_parser().parse_args(["generate", "hi", *a])  # noqa: E731
    assert _generate_spec(parse()).kv_cache_dtype == "auto"
    assert _cluster_spec(parse("--decode", "1", "--kv-cache-dtype", "fp8_e4m3")).kv_cache_dtype == "fp8_e4m3"
    assert all(parse("--kv-cache-dtype", choice).kv_cache_dtype == choice for choice in KV_CACHE_DTYPE_CHOICES)
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "int8")


def test_batch_invariant_flag_reaches_both_paths():
    """`--batch-invariant` reaches the cluster spec and the serve flags; a quantization it cannot run
    is refused in one line naming both."""
    parse = lambda *a: build_parser().parse_args(["generate", "hi", *a])  # noqa: E731
    assert not _generate_spec(parse()).batch_invariant
    assert _cluster_spec(parse("--decode", "1", "--batch-invariant")).batch_invariant
    serve = build_parser().parse_args(["serve", "--batch-invariant"])
    assert serve.batch_invariant
    with pytest.raises(ValueError, match="^batch_invariant runs unquantized weights; quantization int8 cannot run"):
        _cluster_spec(parse("--decode", "1", "--batch-invariant", "--quantization", "int8"))


def test_speculative_flags_reach_both_paths_and_bad_ones_are_refused_first(capsys):
    """`--speculative-*` reach the cluster spec (decode instances only) and the serve flags; a
    combination that cannot work ends `pdserve generate` with one line before any model loads."""
    from cluster.cli.cli import main
    parse = lambda *a: build_parser().parse_args(["generate", "hi", *a])  # noqa: E731
    spec = _cluster_spec(parse("--decode", "1", "--speculative-method", "ngram", "--num-speculative-tokens", "5"))
    assert spec.engine_config("decode").speculative.num_speculative_tokens == 5
    assert spec.engine_config("prefill").speculative is None
    serve = build_parser().parse_args(["serve", "--speculative-model", "d.gguf", "--speculative-max-batch-size", "4"])
    assert (serve.speculative_model, serve.speculative_max_batch_size) == ("d.gguf", 4)
    assert main(["generate", "hi", "--num-speculative-tokens", "3"]) == 2
    assert capsys.readouterr().err.strip() == "pdserve: error: --num-speculative-tokens needs --speculative-method"


@pytest.mark.parametrize("command", ["generate", "serve", "controller", "gateway", "bench", "status", "hash-api-key"])
def test_help_renders(command, capsys):
    """Every subcommand's --help prints (a stray % in a help string makes argparse crash)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0 and "usage: pdserve" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["serve", "--ray-addr", "x"], ["status", "--ur", "http://x"],
                                  ["gateway", "--redis", "redis://x"]])
def test_abbreviated_flags_are_refused(argv, capsys):
    """A prefix of a flag is an unknown flag, refused by name (argparse would take it otherwise)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"unrecognized arguments: {argv[1]}" in err, err


@pytest.mark.parametrize("command", ["controller", "gateway"])
def test_separate_processes_need_ray_and_redis(command, capsys):
    """`pdserve controller|gateway` without --ray-address or --redis-url: one line naming both,
    before anything starts (they meet only in Ray and the cluster state)."""
    from cluster.cli.cli import main
    assert main([command, "--ray-address", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pdserve: error: pdserve {command} needs --ray-address and --redis-url: the controller and "
                   "the gateways are separate processes that meet in Ray and the cluster state"]


def test_hash_api_key_prints_the_sha256_a_keys_file_takes(tmp_path, monkeypatch, capsys):
    """`pdserve hash-api-key` reads the key from stdin (the newline dropped) and prints its hex
    SHA-256, which a keys file takes and the gateway then accepts; an empty stdin, a key with
    whitespace inside (a bearer token has none), or one under 16 characters is refused in one line."""
    import io

    from cluster.cli.cli import main
    from gateway.api_keys import load_api_keys
    from gateway.guard import APIKeyManager
    out = subprocess.run([sys.executable, "-m", "cluster.cli.cli", "hash-api-key"], input="sk-team-a-12345678\n",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == hashlib.sha256(b"sk-team-a-12345678").hexdigest() + "\n", out.stderr
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "team-a", "sha256": out.stdout.strip()}]}))
    assert APIKeyManager(load_api_keys(path)).identify("Bearer sk-team-a-12345678").name == "team-a"
    for text, why in (("\n", "stdin held no key"),
                      ("sk-a sk-b\n", "the key holds whitespace (give one key, on one line)"),
                      ("sk-\u00e9t\u00e9\n", "the key must be printable ASCII"),
                      ("sk-short-123\n", "the key has 12 characters, fewer than 16: make one with `openssl rand -hex 32`")):
        monkeypatch.setattr(sys, "stdin", io.StringIO(text))
        assert main(["hash-api-key"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.splitlines() == [f"pdserve: error: hash-api-key: {why}"]


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_bad_keys_file_or_body_bound_is_refused_in_one_line(command, tmp_path, capsys):
    """`--api-keys-file` that does not parse, or a non-positive `--max-request-bytes`: one line
    naming it, before anything starts."""
    from cluster.cli.cli import main
    shared = ["--ray-address", "127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1"] if command == "gateway" else []
    path = tmp_path / "keys.json"
    path.write_text('{"keys": [{"name": "team-a", "sha256": "sk-not-a-hash"}]}')
    assert main([command, *shared, "--api-keys-file", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pdserve: error: api_keys_file {path}: keys[0].sha256 must be 64 hex digits, the SHA-256 of the key "
        "(`pdserve hash-api-key` prints it), never the key itself"]
    for value in ("0", "-5"):
        assert main([command, *shared, "--max-request-bytes", value]) == 2
        assert capsys.readouterr().err.splitlines() == [f"pdserve: error: max_request_bytes must be >= 1, got {value}"]


@pytest.mark.timeout(300)
def test_generate_through_1p1d_cluster_json():
    """SmolLM2 through one prefill and one decode actor: greedy JSON output with every field, and
    the same tokens as the in-process engine (the LLM API here: what `generate` without cluster
    flags runs, tests/engine/models/test_smollm2.py)."""
    from decode_worker.llm import LLM
    from engine.core.request import SamplingParams
    question = "What is the capital of France?"
    args = [sys.executable, "-m", "cluster.cli.cli", "--log-level", "WARNING", "generate", question, "--chat",
            "--dtype", "float32", "--max-tokens", "8", "--json", "--prefill", "1", "--decode", "1"]
    out = json.loads(subprocess.run(args, capture_output=True, text=True, timeout=280, check=True)
                     .stdout.strip().splitlines()[-1])
    assert {"text", "token_ids", "prompt_token_ids", "ttft_s", "tokens_per_s"} <= set(out)
    here = LLM(model="smollm2", dtype="float32").generate([question], SamplingParams(max_tokens=8, temperature=0.0),
                                                         chat=True)[0]
    assert out["token_ids"] == here.token_ids and "Paris" in out["text"]


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(monkeypatch, capsys):
    """uvicorn re-raises SIGINT once the server has shut down: `pdserve serve` then exits 130, as a
    shell expects of Ctrl-C, instead of printing a KeyboardInterrupt traceback."""
    from cluster.cli import cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_serve", interrupted)
    assert cli.main(["serve"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_a_kv_transport_whose_package_is_missing_is_refused_in_one_line_naming_the_extra(monkeypatch, capsys):
    """`pdserve serve --kv-transport nixl` where NIXL does not import: one line naming the extra,
    before anything starts."""
    from cluster.cli.cli import main
    from kvtransfer import nixl_agent
    monkeypatch.setattr(nixl_agent, "MODULES", ("pdserve_no_such_nixl",))
    assert main(["serve", "--kv-transport", "nixl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kv_transport nixl needs the NIXL package (pip install 'pdserve[nixl]')" in err[0], err
