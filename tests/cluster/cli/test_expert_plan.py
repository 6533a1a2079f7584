"""`pdserve expert-plan` (cluster/cli/expert_plan.py) and `--expert-placement`: a recording turned
into a placement file, the ranks' imbalance before and after printed; a placement a cluster cannot
run refused at start in one line."""
from __future__ import annotations

import json

import pytest

from cluster.cli.cli import main
from cluster.control.cluster import Cluster
from cluster.spec import ClusterSpec
from engine.core.expert_placement import ExpertPlacement
from tests.helpers import FAMILIES, save_tiny

SKEWED = [400, 200, 120, 90, 60, 40, 20, 10]


def test_a_saved_status_becomes_a_placement(tmp_path, capsys):
    """Two instances' counts are summed; the plan fits 2 ranks with 2 replicas, and the printed
    imbalance falls from the contiguous placement's to the plan's."""
    status = {"instances": [{"expert_counts": {"0": SKEWED, "2": SKEWED[::-1]}},
                            {"expert_counts": {"0": SKEWED, "2": SKEWED[::-1]}}, {"expert_counts": None}]}
    (tmp_path / "status.json").write_text(json.dumps(status))
    out = tmp_path / "placement.json"
    assert main(["expert-plan", str(tmp_path / "status.json"), "--ranks", "2", "--replicas", "2", "-o", str(out)]) == 0
    placement = ExpertPlacement.from_file(out)
    assert placement.misfit(8, [0, 2], 2) is None and placement.holders(0)[0] == (0, 1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("layer 0: rank imbalance 1.723 contiguous -> ") and len(lines) == 2
    assert float(lines[0].split("-> ")[1].split()[0]) < 1.02


@pytest.mark.parametrize("content,error", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ('{"instances": [{"expert_counts": {}}]}', "no expert counts in it"),
    ('{"layers": {"0": [1, 2], "1": [1, 2, 3]}}', None),  # layers may differ in size; ranks 2 + 0 replicas fit
])
def test_bad_recordings_are_refused_by_name(tmp_path, capsys, content, error):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    code = main(["expert-plan", str(path), "--ranks", "2"])
    err = capsys.readouterr().err
    if error is None:  # 3 experts over 2 ranks do not fill them evenly: the plan says so
        assert code == 2 and "3 experts + 0 replicas do not fill 2 ranks evenly" in err
    else:
        assert code == 2 and error in err and err.startswith("pdserve: error: "), err


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    kind, switches = FAMILIES["qwen3_moe"]
    return str(save_tiny(tmp_path_factory.mktemp("moe") / "m", kind, **switches))


@pytest.mark.parametrize("knobs,error", [
    (dict(enable_expert_parallel=False), "no instance is expert-parallel (add --enable-expert-parallel)"),
    (dict(enable_expert_parallel=True, decode_tp=4),
     "cannot run m on a colocated instance: it places experts on 2 ranks, the instance has 4"),
])
def test_a_placement_the_cluster_cannot_run_is_refused_first(tmp_path, moe_folder, knobs, error):
    """Before anything starts (Ray not initialized), in one line naming the file."""
    import ray
    path = tmp_path / "p.json"
    path.write_text(ExpertPlacement.contiguous(8, 2, [0, 2]).to_json())
    spec = ClusterSpec(model=moe_folder, dtype="float32", device="cpu", mode="colocated", num_prefill=0,
                       expert_placement=str(path), **knobs)
    cluster = Cluster(spec)
    with pytest.raises(ValueError) as exc:
        cluster.start()
    assert error in str(exc.value) and str(path) in str(exc.value) and "\n" not in str(exc.value)
    assert not cluster.instances and not ray.is_initialized()
