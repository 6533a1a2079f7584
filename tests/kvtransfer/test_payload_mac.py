"""Payload MACs (kvtransfer/wire.py PartMac): with checksums off, one element altered on the
data channel fails the part's MAC: the request is reported failed to the instance (which frees
its blocks), counted and logged, nothing of it is reported complete, and the pair serves on."""
from __future__ import annotations

import pytest
import torch

from kvtransfer.registry import create_kv_transport
from kvtransfer.wire import PartMac
from tests.kvtransfer.faults import corrupt_in_flight
from tests.kvtransfer.test_checksum import ship
from tests.kvtransfer.test_torch_dist import COMPAT, HEADS, make_cache, make_receiver, poll_until, send_part

pytestmark = pytest.mark.timeout(60)


def test_the_mac_is_keyed_and_bound_to_the_part():
    """Same key, part and bytes: the same MAC; another key, request, head or byte: another."""
    a = torch.randn(3, 5)
    def mac(key=b"k" * 32, rid="r", head=0, tokens=3, data=a):
        m = PartMac(key, rid, head, tokens)
        m.update(data)
        return m.value
    assert mac() == mac() and len(mac()) == 32
    altered = a.clone()
    altered[1, 2] += 1
    assert len({mac(), mac(key=b"j" * 32), mac(rid="s"), mac(head=1), mac(tokens=4), mac(data=altered)}) == 6


@pytest.mark.parametrize("path", ["direct", "scattered", "tp_mix"])
def test_an_altered_payload_fails_its_mac_and_the_request_is_dropped(path, caplog):
    """Checksums off: the part's ack names the MAC mismatch; the receiver reports the request
    failed (none complete), counts one mismatch and logs it."""
    rx, dst, src, slots, errors, (done, failed), altered = ship(path, corrupt=True, compat=COMPAT)
    assert len(altered) == 1
    assert sum(e is not None and "MAC mismatch" in e for e in errors) == 1
    assert done == [] and len(failed) == 1 and failed[0][0] == "r" and "MAC mismatch" in failed[0][1]
    assert rx.stats["kv_mac_mismatches"] == 1 and rx.stats["failed"] == 1 and rx._expected == {}
    assert "MAC mismatch" in caplog.text


def test_after_a_mac_mismatch_the_pair_serves_on():
    """The same sender and receiver: a corrupted part fails, the next request arrives intact."""
    rx, dst, dest = make_receiver()
    tx = create_kv_transport("torch").sender(COMPAT, "p0")
    src = make_cache()
    rx.expect("bad", torch.arange(4), 1)
    with corrupt_in_flight(layer=1, times=1):
        with pytest.raises(Exception, match="MAC mismatch"):
            send_part(tx, "bad", dest, src, torch.arange(4), 0, HEADS).wait(10)
    assert [rid for rid, _ in poll_until(rx)[1]] == ["bad"]
    rx.expect("good", torch.arange(4, 8), 1)
    send_part(tx, "good", dest, src, torch.arange(4), 0, HEADS).wait(10)
    assert [c.request_id for c in poll_until(rx)[0]] == ["good"]
    tx.close(), rx.close()
