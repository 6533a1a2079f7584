"""A disk tier under the host tier (issue 51): a block the host tier drops (its least recently used)
is written to a file of its own, and a prompt whose next blocks are there has them read back into
host slots, and from there into its new pool blocks, instead of computing them.

Files: DIR/IDENTITY/HASH.safetensors, HASH the block's chained hash (16 hex digits), one tensor per
KV view of the block (the format the weights come in), the metadata naming the identity, the hash
and an xxh3_64 of the tensors' bytes. IDENTITY (`identity_of`) names the model (its weight files'
names and sizes, their first and last MiB, its config) and the KV format (each view's shape and
dtype, the block size, the attention backend): a file is loaded only when its identity and hash
are this instance's and its bytes hash to its checksum; a corrupted, truncated or foreign file is
refused (counted, logged), forgotten, and its blocks are computed again. Instances of one identity
that share the directory (a shared volume) read each other's blocks.

Bounded by --kv-disk-tier-gib: past it, the least recently used files go. A directory that cannot
be written (read-only, full) degrades with one log line: loads go on, writes stop; nothing raises.

The reads and writes are synchronous, made as the host tier's books change (in the scheduler, on
rank 0, which holds the arena when the instance is one rank): a TP group runs without the disk
tier, with a log line. Overlapping the reads with compute is left. A read lands in a host slot, or,
where a prompt claims more disk blocks than the host tier has slots, is held in memory and copied
into the prompt's new pool block once it is allocated (`read`, `write_block`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

EDGE_BYTES = 1 << 20  # of each weight file, the first and last MiB go into the identity


def checksum(tensors: list[torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


class DiskTier:
    def __init__(self, root: str | os.PathLike, identity: str, capacity_bytes: int,
                 slot_views: Callable[[int], list[torch.Tensor]],
                 block_views: Callable[[int], list[torch.Tensor]] | None = None,
                 block_writer: Callable[[int, list[torch.Tensor]], None] | None = None):
        """`slot_views(slot)`: the host arena's tensors of one slot, one per KV view; `block_views(block
        id)`: the same views of one pool block, on the host (`spill_block`); `block_writer(block id,
        tensors)`: writes a pool block from such tensors (`write_block`: the pool may be on a GPU)."""
        self.dir, self.identity, self.capacity = Path(root) / identity, identity, capacity_bytes
        self.slot_views, self.block_views, self.block_writer = slot_views, block_views, block_writer
        self._files: OrderedDict[int, int] = OrderedDict()  # block hash -> bytes, least recently used first
        self._bytes = 0
        self._refused: set[int] = set()
        self.on_forget: Callable[[int], None] | None = None  # the host tier's: a block it no longer holds
        self.writable = True
        self.stats = {"spilled_blocks": 0, "loaded_blocks": 0, "refused_blocks": 0, "deleted_blocks": 0,
                      "write_failures": 0}
        self.read_s = 0.0  # the loaded blocks' reads and checks, since start (the router weighs tiers by it)
        self._open()

    def _open(self) -> None:
        """The directory, made if missing, and the files of this identity already there, oldest first."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stop_writing(f"cannot make {self.dir} ({exc})")
        if self.writable and not os.access(self.dir, os.W_OK):
            self._stop_writing(f"{self.dir} is not writable")
        found = []
        for path in self.dir.glob("*.safetensors") if self.dir.is_dir() else ():
            try:
                found.append((path.stat().st_mtime, int(path.stem, 16), path.stat().st_size))
            except (OSError, ValueError):
                continue
        for _, key, size in sorted(found):
            self._files[key] = size
            self._bytes += size
        logger.info("KV disk tier: %s, %d blocks there (%.2f of %.2f GiB)%s", self.dir, len(self._files),
                    self._bytes / 2**30, self.capacity / 2**30, "" if self.writable else ", read-only")

    def _path(self, key: int) -> Path:
        return self.dir / f"{key:016x}.safetensors"

    def _stop_writing(self, why: str) -> None:
        if self.writable:
            logger.warning("KV disk tier: writes stop, loads go on: %s", why)
        self.writable = False

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def figures(self) -> dict[str, float]:
        return {"kv_disk_tier_blocks": float(len(self._files)), "kv_disk_tier_bytes": float(self._bytes),
                "kv_disk_tier_read_seconds": self.read_s,
                **{f"kv_disk_tier_{k}": float(v) for k, v in self.stats.items()}}

    def has(self, key: int) -> bool:
        """Whether a file of the block is there (one another instance wrote to a shared directory too)."""
        if key in self._files:
            return True
        if key in self._refused:
            return False
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        self._files[key] = size
        self._bytes += size
        return True

    def spill(self, key: int, slot: int) -> bool:
        """Writes the host slot's block under `key`; whether the tier holds it now."""
        return self._write(key, lambda: self.slot_views(slot))

    def spill_block(self, key: int, block_id: int) -> bool:
        """Writes the pool block `block_id` under `key` (its KV still there); whether the tier holds it."""
        return self.block_views is not None and self._write(key, lambda: self.block_views(block_id))

    def _write(self, key: int, views: Callable[[], list[torch.Tensor]]) -> bool:
        if key in self._files:
            self._files.move_to_end(key)
            return True
        if not self.writable:
            return False
        tensors = views()
        named = {f"v{i}": t.contiguous() for i, t in enumerate(tensors)}
        meta = {"identity": self.identity, "block": f"{key:016x}", "xxh3_64": checksum(list(named.values()))}
        path, tmp = self._path(key), self.dir / f".{key:016x}.{os.getpid()}.tmp"
        try:
            save_file(named, str(tmp), metadata=meta)
            os.replace(tmp, path)  # readers see a whole file or none
            size = path.stat().st_size
        except OSError as exc:  # read-only, full: writes stop
            self.stats["write_failures"] += 1
            tmp.unlink(missing_ok=True)
            self._stop_writing(f"writing {path} failed ({exc})")
            return False
        except Exception as exc:  # noqa: BLE001 -- this block only: the instance serves on without it on disk
            self.stats["write_failures"] += 1
            tmp.unlink(missing_ok=True)
            logger.warning("KV disk tier: block %016x not written (%s: %s)", key, type(exc).__name__, exc)
            return False
        self._files[key] = size
        self._bytes += size
        self._refused.discard(key)
        self.stats["spilled_blocks"] += 1
        while self._bytes > self.capacity and len(self._files) > 1:
            old, _ = next(iter(self._files.items()))
            self._delete(old)
            self.stats["deleted_blocks"] += 1
        return True

    def load(self, key: int, slot: int) -> bool:
        """Reads the block `key` into the host slot; False (nothing written to the slot) if it is not
        there or is refused: another identity's or block's, not these views, truncated, or corrupt."""
        tensors = self.read(key)
        if tensors is None:
            return False
        for dst, src in zip(self.slot_views(slot), tensors):
            dst.copy_(src)
        return True

    def write_block(self, block_id: int, tensors: list[torch.Tensor]) -> None:
        """Copies a block `read` gave into the pool block `block_id` (no step may be running)."""
        self.block_writer(block_id, tensors)

    def read(self, key: int) -> list[torch.Tensor] | None:
        """The block `key`'s tensors, checked (as `load` says), or None."""
        if not self.has(key):
            return None
        start = time.perf_counter()
        out = self.slot_views(0)  # (only their shapes and dtypes)
        try:
            with safe_open(str(self._path(key)), framework="pt") as f:
                meta = f.metadata() or {}
                names = sorted(f.keys(), key=lambda n: int(n[1:]))
                tensors = [f.get_tensor(n) for n in names]
        except FileNotFoundError:
            self._forget(key)  # deleted meanwhile (another instance sharing the directory)
            return None
        except Exception as exc:  # noqa: BLE001 -- safetensors' errors: a truncated or unreadable file
            return self._refuse(key, f"unreadable ({type(exc).__name__}: {exc})")
        if meta.get("identity") != self.identity or meta.get("block") != f"{key:016x}":
            return self._refuse(key, f"another model, format or block ({meta.get('identity')}/{meta.get('block')})")
        if [(t.shape, t.dtype) for t in tensors] != [(t.shape, t.dtype) for t in out]:
            return self._refuse(key, "not this KV format's views")
        if checksum(tensors) != meta.get("xxh3_64"):
            return self._refuse(key, "checksum mismatch (corrupt)")
        self._files.move_to_end(key)
        self.stats["loaded_blocks"] += 1
        self.read_s += time.perf_counter() - start
        return tensors

    def _refuse(self, key: int, why: str) -> None:
        logger.warning("KV disk tier: refused %s: %s; its tokens are computed again", self._path(key), why)
        self.stats["refused_blocks"] += 1
        self._refused.add(key)
        self._forget(key)

    def _forget(self, key: int) -> None:
        self._bytes -= self._files.pop(key, 0)
        if self.on_forget is not None:
            self.on_forget(key)

    def _delete(self, key: int) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            self._stop_writing(f"deleting {self._path(key)} failed ({exc})")
        self._forget(key)

    def clear(self) -> None:
        """Deletes this instance's known files (the prefix cache was reset: the KV may be stale)."""
        for key in list(self._files):
            self._delete(key)


def identity_of(model_path: Path, kv_views: list[torch.Tensor], block_size: int, backend: str) -> str:
    """16 hex digits naming the model (weight files' names, sizes, first and last MiB; config) and
    the KV format (each view's block shape and dtype, the block size, the backend)."""
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
    h.update(json.dumps(fmt, sort_keys=True).encode())
    return h.hexdigest()
