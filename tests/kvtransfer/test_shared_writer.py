"""The same-device writer's order and lifetime rules (kvtransfer/scatter.py), on a CPU with
fake CUDA streams and events (tests/kvtransfer/fake_cuda.py): the side stream waits on the
cache's export event before any copy, and on each layer's ready event before that layer's copy;
a step's copies cost one event; a payload lives until an event after its copy completed; copies
that never complete keep their payloads and the mapping."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvtransfer.scatter import SharedCacheManager, SharedCacheWriter, StalledWrites
from tests.kvtransfer.fake_cuda import CacheWrites, FakeEvent, FakeStream
from tests.kvtransfer.test_torch_dist import BLOCK, LAYERS, flat, make_cache

RUNS = {"few runs": [(0, 2 * BLOCK, 3 * BLOCK), (2 * BLOCK, BLOCK, 9 * BLOCK)],  # slice copies
        "many runs": [(i * BLOCK, BLOCK, b * BLOCK) for i, b in enumerate((9, 1, 7, 3, 12, 5))]}  # one scatter


def writer_and_target(log: list, runs, completes: bool = True, export: bool = True):
    cache = make_cache(fill=0.0)
    writer = SharedCacheWriter(cache, 0, stream=FakeStream(log, completes),
                               export_event=FakeEvent("export") if export else None)
    num_tokens = sum(length for _, length, _ in runs)
    target = writer.target([[start, length] for start, length, _ in runs], [slot for *_, slot in runs], num_tokens)
    return cache, writer, target, num_tokens


def payload(src: torch.Tensor, layer: int, num_tokens: int) -> torch.Tensor:
    return flat(src, layer)[:, :num_tokens].clone()  # (2, tokens, heads, head_dim)


@pytest.mark.parametrize("runs", RUNS.values(), ids=RUNS.keys())
def test_each_copy_waits_for_the_export_event_and_its_layers_ready_event(runs):
    """In the log of waits and writes into the cache: the export event is waited on before any
    write, and each layer's ready event before the first write into that layer; the cache then
    holds the payloads at the runs' slots."""
    log = []
    cache, writer, target, num_tokens = writer_and_target(log, runs)
    src = make_cache()
    with CacheWrites(log, cache):
        for layer in range(LAYERS):
            writer.write(layer, target, payload(src, layer, num_tokens), FakeEvent(f"ready{layer}"), 0)
    writer.settle(1.0)
    writes = [i for i, (kind, _) in enumerate(log) if kind == "write"]
    assert writes and log.index(("wait", "export")) < writes[0]
    for layer in range(LAYERS):
        assert log.index(("wait", f"ready{layer}")) < log.index(("write", layer))
    for layer in range(LAYERS):
        for start, length, slot in runs:
            assert torch.equal(flat(cache, layer)[:, slot:slot + length], flat(src, layer)[:, start:start + length])


def test_a_steps_copies_cost_one_event_and_their_payloads_live_until_it_completed():
    """settle records one event for every copy since the last settle (none when there was none);
    the payloads stay referenced by the writer until then, and no longer."""
    log = []
    _, writer, target, num_tokens = writer_and_target(log, RUNS["few runs"])
    src = make_cache()
    refs = []
    for layer in range(LAYERS):
        kv = payload(src, layer, num_tokens)
        refs.append(weakref.ref(kv))
        writer.write(layer, target, kv, None, 0)
        del kv
    gc.collect()
    assert all(r() is not None for r in refs)
    writer.settle(1.0)
    writer.settle(1.0)  # nothing new: no event
    gc.collect()
    assert all(r() is None for r in refs)
    assert [entry for entry in log if entry[0] == "record"] == [("record", "recorded1")]


def test_copies_that_never_complete_keep_their_payloads_and_the_mapping():
    """An event that never completes: settle raises StalledWrites after its deadline and release
    keeps the payloads and the cache; once the copies complete, release lets go of both."""
    log = []
    _, writer, target, num_tokens = writer_and_target(log, RUNS["many runs"], completes=False)
    kv = payload(make_cache(), 0, num_tokens)
    ref = weakref.ref(kv)
    writer.write(0, target, kv, None, 0)
    del kv
    with pytest.raises(StalledWrites):
        writer.settle(0.05)
    assert not writer.release(0.05)
    gc.collect()
    assert ref() is not None and writer.cache is not None
    writer.stream.completes = True  # the copy finished at last
    assert writer.release(0.05)
    gc.collect()
    assert ref() is None and writer.cache is None


def test_a_manager_parks_a_stalled_writer_until_its_copies_complete():
    """closed() releases a writer whose copies completed; a stalled one is parked, and reap()
    lets it go once they complete."""
    log = []
    manager = SharedCacheManager()
    done_writer = writer_and_target(log, RUNS["few runs"])[1]
    assert manager.closed("a", done_writer, 0.05) and done_writer.cache is None
    _, stalled, target, num_tokens = writer_and_target(log, RUNS["few runs"], completes=False)
    stalled.write(0, target, payload(make_cache(), 0, num_tokens), None, 0)
    assert not manager.closed("b", stalled, 0.05)
    assert manager.reap() == 1 and stalled.cache is not None
    stalled.stream.completes = True
    assert manager.reap() == 0 and stalled.cache is None


def test_a_restarted_process_at_the_same_address_makes_the_older_holder_stale():
    """opened() names the holders of a cache of the same address from another process only."""
    manager = SharedCacheManager()
    assert manager.opened("p1", ("h", 1), 100) == []
    assert manager.opened("p2", ("h", 2), 200) == []  # another address
    assert manager.opened("p3", ("h", 1), 100) == []  # the same process: a second connection
    assert manager.opened("p4", ("h", 1), 101) == ["p1", "p3"]
