"""One connection's NIXL reads of its prefill rank's pool: posting a part's reads (nixl_reads.py's
ranges), waiting for them under a deadline, staging slabs, and aborting what is in flight.

It stands where the torch transport's data channel does in a session (session.py): `wait`,
`close`, `writing` and `settle` as channel.py's, failures as ChannelError (the session then drops
the connection, the part fails, and the sender's next `begin` connects again).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from kvtransfer.channel import POLL_S, ChannelError
from kvtransfer.nixl_agent import mem_type, register
from kvtransfer.nixl_reads import PoolShape, ReadPlan

logger = logging.getLogger(__name__)


class NixlReads:
    def __init__(self, agent, remote: str, src: PoolShape, dst: PoolShape, device: torch.device, depth: int):
        """`remote`: the prefill rank's agent (added); `src`, `dst`: its pool and this rank's;
        `depth`: staging slabs (one per layer in flight)."""
        self.agent, self.remote, self.src, self.dst, self.device = agent, remote, src, dst, device
        self.staging: list[tuple[torch.Tensor, object] | None] = [None] * depth  # (slab, its registration)
        self._lock = threading.Lock()
        self._pending: set = set()  # handles posted, not yet released
        self.closed = False

    def stage(self, i: int, plan: ReadPlan) -> torch.Tensor:
        """Staging slab `i`, registered, holding a layer of `plan`'s blocks (grown when short)."""
        size = plan.staging_blocks * 2 * self.src.plane_block_bytes
        held = self.staging[i]
        if held is None or held[0].numel() < size:
            if held is not None:
                self.agent.deregister_memory(held[1])
            slab = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.staging[i] = held = (slab, register(self.agent, slab))
        return held[0][:size]

    def read(self, plan: ReadPlan, layers: range, staging: torch.Tensor | None, cache: torch.Tensor):
        """Posts the reads of `layers` of `plan`: into `cache` (direct) or `staging` (one layer).
        Returns (handle, bytes); ChannelError when NIXL refuses them."""
        src_bases = [self.src.addr + layer * self.src.slab_bytes for layer in layers]
        if staging is None:
            dst_bases, into = [cache.data_ptr() + layer * self.dst.slab_bytes for layer in layers], cache
        else:
            assert len(layers) == 1, layers
            dst_bases, into = [staging.data_ptr()], staging
        local, remote = plan.ranges(self.src, self.dst, src_bases, dst_bases)
        with self._lock:
            if self.closed:
                raise ChannelError("the connection is closed")
            try:
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, mem_type(into)),
                                                    self.agent.get_xfer_descs(remote, self.src.mem), self.remote)
            except Exception as exc:
                raise ChannelError(f"NIXL refused the reads: {type(exc).__name__}: {str(exc)[:200]}") from None
            self._pending.add(handle)
        try:
            if self.agent.transfer(handle) == "ERR":
                raise ChannelError("NIXL failed to post the reads")
        except ChannelError:
            self._release(handle)
            raise
        except Exception as exc:
            self._release(handle)
            raise ChannelError(f"NIXL failed to post the reads: {type(exc).__name__}: {str(exc)[:200]}") from None
        return handle, int(local[:, 1].sum())

    def wait(self, handle, timeout_s: float) -> None:
        """Returns once the reads of `handle` landed. ChannelError when they failed (the peer gone)
        or past `timeout_s` (they are aborted first: nothing of them lands afterwards)."""
        deadline = time.monotonic() + timeout_s
        try:
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise ChannelError(f"NIXL reads did not land within {timeout_s:.0f} s")
                time.sleep(POLL_S)
            if state != "DONE":
                raise ChannelError("NIXL reads failed")
        except ChannelError:
            self._release(handle)
            self.close()
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and the like: the peer is gone
            self._release(handle)
            self.close()
            raise ChannelError(f"NIXL reads failed: {type(exc).__name__}: {str(exc)[:200]}") from None
        self._release(handle)

    def _release(self, handle) -> None:
        """Releases `handle` (aborting it if still in flight)."""
        with self._lock:
            if handle not in self._pending:
                return
            self._pending.discard(handle)
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:  # could not abort: its destination stays reserved until the connection ends
            logger.warning("NIXL reads from %s could not be released: %s", self.remote, exc)

    def writing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # a read is complete when NIXL says DONE: nothing to order after it

    def settle(self, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        """Aborts the reads in flight and frees the staging slabs (repeatable, any thread)."""
        with self._lock:
            self.closed = True
            pending, self._pending = list(self._pending), set()
        for handle in pending:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:
                logger.warning("NIXL reads from %s could not be aborted: %s", self.remote, exc)

    def free_staging(self) -> None:
        """Deregisters the staging slabs (once no read can use them)."""
        for i, held in enumerate(self.staging):
            if held is not None:
                self.staging[i] = None
                try:
                    self.agent.deregister_memory(held[1])
                except Exception as exc:
                    logger.debug("NIXL staging deregistration: %s", exc)
