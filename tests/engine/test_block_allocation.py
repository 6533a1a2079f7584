"""Where new blocks lie: handed out in id order (a request freed is reused as one run), and a
reservation for remote KV asks for consecutive blocks, so the transfer lands straight in the cache."""
from __future__ import annotations

import random

from tests.engine.test_block_manager import (BLOCK_SIZE, create_manager, create_requests, free_and_assert_no_leaks,
                                             prefill)


def test_new_blocks_come_in_id_order_so_a_freed_request_returns_as_one_run():
    """Which blocks are taken follows the LRU queue; they are handed out sorted, so a request's
    blocks (freed tail first, so reversed in the queue) come back as consecutive ids."""
    mgr = create_manager(num_blocks=37, enable_prefix_caching=False)  # 36 usable: 12 requests x 3 blocks
    reqs = create_requests(12, 40)
    for req in reqs:
        prefill(mgr, req)
    ids = {req.request_id: mgr.get_block_ids(req.request_id) for req in reqs}
    random.Random(0).shuffle(reqs)
    mgr.free(reqs[0])
    (one,) = create_requests(1, 40, start=20)
    _, new = prefill(mgr, one)
    assert [blk.block_id for blk in new] == sorted(ids[reqs[0].request_id])
    assert [blk.block_id for blk in new] == list(range(new[0].block_id, new[0].block_id + 3))
    for req in reqs[1:7]:
        mgr.free(req)
    (six,) = create_requests(1, 6 * 3 * BLOCK_SIZE, start=21)
    _, new = prefill(mgr, six)
    assert [blk.block_id for blk in new] == sorted(i for req in reqs[1:7] for i in ids[req.request_id])
    free_and_assert_no_leaks(mgr, *reqs[7:], one, six)
