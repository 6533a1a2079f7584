"""bench/multiturn.py's pieces that need no server: its options, the `pdserve serve` command line
of each target (every flag one the real CLI takes), and its table (the server runs in BENCHMARKS.md)."""
from __future__ import annotations

import pytest

from bench import multiturn
from cluster.cli.cli import build_parser


def test_each_target_gets_flags_the_cli_takes_and_a_fresh_disk_directory(tmp_path):
    args = multiturn.parse_args(["--targets", "1P1D,1P1D-off,2P2D", "--disk-tier-gib", "0.5",
                                 "--log-dir", str(tmp_path)])
    args.num_kv_blocks = 100
    dirs = []
    for target in args.targets:
        argv, _, ready = multiturn.server_argv(target, 8000, args)
        assert argv[1:4] == ["-m", "cluster.cli.cli", "serve"] and ready == "/ready"
        parsed = build_parser().parse_args(argv[3:])
        if target.endswith("-off"):
            given = vars(parsed)  # (the CLI leaves out what was not given: the spec's defaults apply)
            assert "kv_disk_tier_gib" not in given and "kv_host_tier_gib" not in given and not parsed.kv_delta
            assert not parsed.kv_fetch
        else:
            assert (parsed.kv_host_tier_gib, parsed.kv_disk_tier_gib) == (1.0, 0.5)
            dirs.append(parsed.kv_disk_tier_dir)
    assert len(set(dirs)) == 2 and all(d.startswith(str(tmp_path)) for d in dirs)


@pytest.mark.parametrize("argv", [["--disk-tier-gib", "-1"], ["--tier-gib", "0"], ["--pool-fraction", "0"],
                                  ["--targets", "3P3D"]])
def test_values_that_cannot_work_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        multiturn.parse_args(argv)
    assert "error:" in capsys.readouterr().err


def test_the_table_shows_reloads_and_disk_reads_per_turn():
    turn = {"prompt_tokens": 5000, "cached_tokens": 3600, "tier_reloaded_blocks": 20, "disk_loaded_blocks": 5,
            "reused_tokens": 3200, "kv_bytes": 96e6, "ttft_p50_s": 0.7}
    result = {"workload": {"num_sessions": 2, "num_turns": 1, "concurrency": 1, "output_tokens": 32,
                           "num_kv_blocks": 100, "block_size": 16, "working_set_tokens": 9000},
              "targets": {"1P1D": {"turns": [turn], "ttft_p50_s": 0.7, "ttft_p99_s": 2.0, "itl_p50_s": 0.08,
                                   "output_tok_s": 35.0, "num_failed": 0}}}
    row = multiturn.format_table(result).splitlines()[-1]
    assert row.startswith("1P1D") and "5000/3600(320;80)/3200/96.0/700" in row


def test_the_run_reports_the_tier_weights_the_router_would_measure():
    """1 ms a prompt token, 0.4 ms a block reloaded, 2 ms a block read from disk (blocks of 4)."""
    turns = [{"prefill_tokens": 512, "prefill_s": 0.512, "tier_reloaded_blocks": 50, "reload_s": 0.02,
              "disk_loaded_blocks": 25, "disk_read_s": 0.05}] * 2
    assert multiturn.measured_weights(turns, 4) == pytest.approx({"+": 1.0, "h": 0.9, "d": 0.4})
