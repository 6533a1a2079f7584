"""Disaggregated equals colocated, bit for bit, over a pairwise design of the serving factors
(tests/exactness/matrix.py), in the batch-invariant mode."""
from __future__ import annotations

import pytest

from tests.exactness.matrix import Case, mismatches, pairwise_cases, reference, serve

pytestmark = pytest.mark.timeout(300)
CASES = pairwise_cases()


@pytest.fixture(scope="module")
def references(model):
    """The reference outputs per KV dtype, served once."""
    return {kv: serve(reference(kv), model) for kv in ("auto", "fp8_e4m3")}


def test_the_design_covers_every_pair():
    """Every two factors' values meet in some case, and the design is smaller than the product."""
    from itertools import combinations
    from tests.exactness.matrix import FACTORS
    names = list(FACTORS)
    for a, b in combinations(names, 2):
        met = {(getattr(c, a), getattr(c, b)) for c in CASES}
        assert met == {(x, y) for x in FACTORS[a] for y in FACTORS[b]}, (a, b)
    assert len(CASES) < 32


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_equals_colocated(case: Case, model, references, request):
    if case.needs_ray:
        request.getfixturevalue("ray_session")
    counts = {}
    assert mismatches(serve(case, model, counts=counts), references[case.kv_dtype]) == []
    # how often the small pool preempted depends on how the requests interleave (none, one at a
    # time); tests/engine/test_batch_invariant.py forces preemptions and checks them bit for bit
    request.node.user_properties.append(("preemptions", counts["preemptions"]))
