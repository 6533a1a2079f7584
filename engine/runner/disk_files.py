"""One rank's files of the disk tier (engine/runner/disk_tier.py keeps the books, on rank 0): the
writes and deletes a step carries (TierCopies.disk, synchronous, before the step's copies) and the
reads, on a reader thread of their own, into memory ("staged") while steps run, answered by `poll`.

Files: DIR/IDENTITY/HASH.safetensors, HASH the block's chained hash (16 hex digits; `-g<group>` after
it for a KV group but the first: engine/core/block_manager.py keys), one tensor per
KV view of the block (the format the weights come in), the metadata naming the identity, the hash
and an xxh3_64 of the tensors' bytes. IDENTITY (`identity_of`) names the model (its weight files'
names and sizes, their first and last MiB, its config), the KV format (each view's shape and dtype,
the block size, the attention backend) and, under tensor parallelism, the rank's shard: each rank
writes and reads the files of its own heads. A file is loaded only when its identity and hash are
this rank's and its bytes hash to its checksum; a corrupted, truncated or foreign file is refused
(logged; the books count it and forget the block, whose tokens are computed again). Writes go to a
temporary file renamed into place: a reader never sees half a block. A directory that cannot be
written (read-only, full) degrades with one log line: loads go on, writes stop; nothing raises.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from engine.core.tier_copies import BLOCK, DELETE, SLOT

logger = logging.getLogger(__name__)

EDGE_BYTES = 1 << 20  # of each weight file, the first and last MiB go into the identity
OK, GONE = "ok", "gone"  # a read's answers besides a refusal's reason
HEADER_BYTES = 1024  # a file's safetensors header, about: what the books count beside the tensors' bytes


def key_name(key) -> str:
    """A block key's file stem: group 0's hash in 16 hex digits, another group's with `-g<group>`."""
    return f"{key:016x}" if type(key) is int else f"{key[1]:016x}-g{key[0]}"


def key_of(name: str):
    """`key_name`'s inverse; ValueError for a name it does not make."""
    head, _, group = name.partition("-g")
    if len(head) != 16 or (group and not group.isdigit()):
        raise ValueError(name)
    return int(head, 16) if not group else (int(group), int(head, 16))


def checksum(tensors: list[torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


class DiskFiles:
    """One rank's files of the disk tier: its writes and deletes, made as a step says, and its reads,
    on a thread, into memory until a load copies them into a pool block or a drop lets them go."""

    def __init__(self, root: str | os.PathLike, identity: str,
                 slot_views: Callable[[int], list[torch.Tensor]],
                 block_views: Callable[[int], list[torch.Tensor]] | None = None):
        """`slot_views(slot)`: the host arena's tensors of one slot, one per KV view; `block_views(block
        id)`: the same views of one pool block, on the host (a write from the pool)."""
        self.dir, self.identity = Path(root) / identity, identity
        self.slot_views, self.block_views = slot_views, block_views
        self.writable = True
        self.stats = {"write_failures": 0}
        self.read_s = 0.0  # this rank's checked reads, since start (the router weighs tiers by rank 0's)
        self._staged: dict[int, list[torch.Tensor]] = {}
        self._answers: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the staged reads: the reader thread adds, the step takes
        self._reader: ThreadPoolExecutor | None = None  # made at the first read
        self._mkdir()

    def _mkdir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stop_writing(f"cannot make {self.dir} ({exc})")
        if self.writable and not os.access(self.dir, os.W_OK):
            self._stop_writing(f"{self.dir} is not writable")

    def found(self) -> list[tuple[int, int]]:
        """The files of this identity already there, oldest first: (block hash, bytes)."""
        found = []
        for path in self.dir.glob("*.safetensors") if self.dir.is_dir() else ():
            try:
                found.append((path.stat().st_mtime, key_of(path.stem), path.stat().st_size))
            except (OSError, ValueError):
                continue
        return [(key, size) for _, key, size in sorted(found, key=lambda f: f[0])]

    def path(self, key) -> Path:
        return self.dir / f"{key_name(key)}.safetensors"

    def _stop_writing(self, why: str) -> None:
        if self.writable:
            logger.warning("KV disk tier: writes stop, loads go on: %s", why)
        self.writable = False

    # -- the step's ops --------------------------------------------------------------------------
    def apply(self, ops: list[tuple[str, int, int]]) -> None:
        """A step's writes and deletes, in order (engine/core/tier_copies.py)."""
        for op, key, where in ops:
            if op == SLOT:
                self.write(key, self.slot_views(where))
            elif op == BLOCK:
                self.write(key, self.block_views(where))
            elif op == DELETE:
                self.delete(key)

    def write(self, key: int, tensors: list[torch.Tensor]) -> bool:
        if not self.writable:
            return False
        named = {f"v{i}": t.contiguous() for i, t in enumerate(tensors)}
        meta = {"identity": self.identity, "block": key_name(key), "xxh3_64": checksum(list(named.values()))}
        path, tmp = self.path(key), self.dir / f".{key_name(key)}.{os.getpid()}.tmp"
        try:
            save_file(named, str(tmp), metadata=meta)
            os.replace(tmp, path)  # readers see a whole file or none
        except OSError as exc:  # read-only, full: writes stop
            self.stats["write_failures"] += 1
            tmp.unlink(missing_ok=True)
            self._stop_writing(f"writing {path} failed ({exc})")
            return False
        except Exception as exc:  # noqa: BLE001 -- this block only: the instance serves on without it on disk
            self.stats["write_failures"] += 1
            tmp.unlink(missing_ok=True)
            logger.warning("KV disk tier: block %s not written (%s: %s)", key_name(key), type(exc).__name__, exc)
            return False
        return True

    def delete(self, key: int) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            self._stop_writing(f"deleting {self.path(key)} failed ({exc})")

    # -- reads -------------------------------------------------------------------------------------
    def start_reads(self, keys: list[int]) -> None:
        """Reads (and checks) the blocks on the reader thread; each is answered by `poll`."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        for key in keys:
            self._reader.submit(self._answer, key)

    def _answer(self, key: int) -> None:
        try:
            answer = self.read(key)
        except Exception as exc:  # noqa: BLE001 -- one block's read: computed instead, never a stuck request
            answer = self._refuse(key, f"{type(exc).__name__}: {exc}")
        self._answers.put((key, answer))

    def read(self, key: int) -> str:
        """Reads the block `key` into memory (staged) and answers OK, GONE (no such file), or why it is
        refused: another identity's or block's, not these views, truncated, or corrupt."""
        start = time.perf_counter()
        want = self.slot_views(0)  # (only their shapes and dtypes)
        try:
            with safe_open(str(self.path(key)), framework="pt") as f:
                meta = f.metadata() or {}
                names = sorted(f.keys(), key=lambda n: int(n[1:]))
                tensors = [f.get_tensor(n) for n in names]
        except FileNotFoundError:
            return GONE  # deleted meanwhile (another instance sharing the directory), or never written
        except Exception as exc:  # noqa: BLE001 -- safetensors' errors: a truncated or unreadable file
            return self._refuse(key, f"unreadable ({type(exc).__name__}: {exc})")
        if meta.get("identity") != self.identity or meta.get("block") != key_name(key):
            return self._refuse(key, f"another model, format or block ({meta.get('identity')}/{meta.get('block')})")
        if [(t.shape, t.dtype) for t in tensors] != [(t.shape, t.dtype) for t in want]:
            return self._refuse(key, "not this KV format's views")
        if checksum(tensors) != meta.get("xxh3_64"):
            return self._refuse(key, "checksum mismatch (corrupt)")
        with self._lock:
            self._staged[key] = tensors
        self.read_s += time.perf_counter() - start
        return OK

    def _refuse(self, key: int, why: str) -> str:
        logger.warning("KV disk tier: refused %s: %s; its tokens are computed again", self.path(key), why)
        return why

    def poll(self, wait_s: float = 0.0) -> list[tuple[int, str]]:
        """The reads ended since the last poll: (block hash, answer). `wait_s`: wait that long for the
        first when none has ended (a caller with nothing else to do)."""
        out = []
        try:
            if wait_s > 0:
                out.append(self._answers.get(timeout=wait_s))
            while True:
                out.append(self._answers.get_nowait())
        except queue.Empty:
            return out

    def take_staged(self, key: int) -> list[torch.Tensor]:
        with self._lock:
            return self._staged.pop(key)

    def drop(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._staged.pop(key, None)

    @property
    def num_staged(self) -> int:
        return len(self._staged)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)


def identity_of(model_path: Path, kv_views: list[torch.Tensor], block_size: int, backend: str,
                shard: tuple[int, int] = (0, 1)) -> str:
    """16 hex digits naming the model (weight files' names, sizes, first and last MiB; config), the
    KV format (each view's block shape and dtype, the block size, the backend) and, with more than
    one TP rank, the rank's shard (rank, size)."""
    h = xxhash.xxh3_64()
    files = [model_path] if model_path.is_file() else sorted(model_path.glob("*.safetensors")) + \
        [p for p in (model_path / "config.json",) if p.is_file()]
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(EDGE_BYTES))
            f.seek(max(0, size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
    fmt = {"views": [[list(v.shape[1:]), str(v.dtype)] for v in kv_views], "block_size": block_size,
           "backend": backend}
    if shard[1] > 1:
        fmt["shard"] = list(shard)
    h.update(json.dumps(fmt, sort_keys=True).encode())
    return h.hexdigest()
