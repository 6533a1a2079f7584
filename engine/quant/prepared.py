"""The prepared linear layers cached on disk: what a quantized method's kernels `prepare` from a
layer's weights (int4 codes packed for `_weight_int4pack_mm_for_cpu`, weights dequantized for the
unquantized path, a Q8_0 head's two int4 planes) takes a rank about 1 s of every start on SmolLM2;
read back it takes ~0.1 s (BENCHMARKS.md "Cold start after (issue 55 item 3)").

One safetensors file per (checkpoint, TP rank, method), under `$PDSERVE_PREPARED_CACHE_DIR`, else
`$PDSERVE_CACHE_DIR` (default ~/.cache/pdserve), read by memory map (the tensors are views of the file's pages, shared by every
rank that reads it):

    prepared-<checkpoint stem>-<slot>-<key>.safetensors
        slot: the checkpoint's resolved path, the method, the rank's TP place, dtype, device
        key:  everything the prepared tensors depend on: the slot; the checkpoint's size and mtime;
              the kernel chosen per batch-size range; torch's version; the processor; the layers'
              names and shapes; engine/quant's source (a change to the code that prepares them is
              a new key, never a stale file read as current)

The key is also stored in the file and compared on reading. A file that is absent, unreadable,
of another key, or lacks a layer is logged and the layers are prepared as without a cache, then
the file is written again: to a temporary file renamed into place, so that no reader sees it half
written; the files of older keys of the same slot are deleted then. What a kernel keeps that is not
plain tensors (oneDNN's packed weight, fbgemm's packed parameters) is rebuilt from tensors
(`LinearKernel.state_tensors` / `restore`), or not cached at all (logged). `PDSERVE_PREPARED_CACHE=0`
turns the cache off; `rm ~/.cache/pdserve/prepared-*` clears it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.core.config import cache_dir

logger = logging.getLogger(__name__)

FORMAT = "1"  # bump when the file's layout changes
_SEP = "|"  # tensor names: "<layer name>|<kernel>|<index>"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source_stats(path: Path) -> list:
    """What identifies a checkpoint's bytes without reading them: each file's name, size and mtime."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json"))
    return [[p.name, (s := p.stat()).st_size, s.st_mtime_ns] for p in files]


@functools.cache
def _code_digest() -> str:
    """A digest of engine/quant's source: the code that prepares the layers (any change: a new key)."""
    return _digest("".join(p.read_text() for p in sorted(Path(__file__).parent.glob("*.py"))))


class PreparedCache:
    """Where one rank's model caches its prepared layers; each quantized method opens its own file
    (`open`). Made by `for_model`, which returns None (logged why) where no cache applies."""

    def __init__(self, folder: Path, source: Path, slot: dict, identity: dict):
        self.folder, self.source, self.slot, self.identity = folder, source, slot, identity

    @classmethod
    def for_model(cls, path, tp_rank: int, tp_size: int, dtype: torch.dtype,
                  device: torch.device) -> PreparedCache | None:
        """The cache of a model loaded from `path` (a GGUF file or a safetensors folder) by this rank."""
        why = ("weights given in memory (no checkpoint file to key them by)" if path is None else
               "PDSERVE_PREPARED_CACHE=0" if os.environ.get("PDSERVE_PREPARED_CACHE", "1") == "0" else
               f"device {device.type} (a CPU cache: layers are prepared on the device)" if device.type != "cpu"
               else None)
        if why is not None:
            logger.info("prepared-layer cache: off, %s", why)
            return None
        from engine.quant.selection import processor_name
        source = Path(path).resolve()
        slot = {"source": str(source), "tp_rank": tp_rank, "tp_size": tp_size, "dtype": str(dtype),
                "device": device.type}
        identity = {**slot, "format": FORMAT, "files": _source_stats(source), "torch": torch.__version__,
                    "processor": processor_name(device), "python": sys.version_info[:2]}
        folder = os.environ.get("PDSERVE_PREPARED_CACHE_DIR")
        return cls(Path(folder).expanduser() if folder else cache_dir(), source, slot, identity)

    def open(self, what: str, options: dict, shapes: dict[str, tuple[int, int]], kernels: dict[str, Any],
             choices: list) -> PreparedFile:
        """The file of one method's prepared layers. what: the method's name; options: what else of
        the method its preparation depends on; shapes: each layer's name (`layer_name`) and (out, in);
        kernels: name -> LinearKernel; choices: the KernelChoice per batch-size range."""
        key = {**self.identity, "method": what, "options": options, "code": _code_digest(),
               "choices": [[c.max_m, c.kernel] for c in choices],
               "layers": sorted([name, list(shape)] for name, shape in shapes.items())}
        text = json.dumps(key, sort_keys=True)
        slot = _digest(json.dumps({**self.slot, "method": what}, sort_keys=True))
        stem = f"prepared-{self.source.stem}-{slot}"
        return PreparedFile(self.folder / f"{stem}-{_digest(text)}.safetensors", text, kernels, what)


class PreparedFile:
    """One method's prepared layers: read from the file when it holds them (`states`), else kept as
    they are prepared (`keep`) and written at `finish`."""

    def __init__(self, path: Path, key: str, kernels: dict[str, Any], what: str):
        self.path, self.key, self.kernels, self.what = path, key, kernels, what
        self.new: dict[str, torch.Tensor] = {}
        self.missing = 0  # layers the file lacked (prepared instead)
        self.uncacheable = False  # a kernel's state is not plain tensors: nothing is written
        self.aliases: dict[str, str] = {}  # tensor name -> the name it is written under (the same tensor)
        self._written: dict[tuple, str] = {}  # (storage, offset, shape, strides, dtype) -> name, of `new`
        self.read = 0
        self.start = time.perf_counter()
        self.found = self._read()  # tensor name -> tensor (views of the mapped file), or None

    def _read(self) -> dict[str, torch.Tensor] | None:
        if not self.path.exists():
            logger.info("prepared layers (%s): none cached at %s yet; preparing them (written after)", self.what,
                        self.path)
            return None
        try:
            with safe_open(self.path, framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key:
                    logger.warning("prepared layers (%s): %s holds other layers (its key differs); preparing them "
                                   "again", self.what, self.path)
                    return None
                self.aliases = json.loads(meta.get("aliases", "{}"))
                return {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # noqa: BLE001 - a cache: whatever it holds, the layers can be prepared instead
            logger.warning("prepared layers (%s): %s unreadable (%s: %s); preparing them again", self.what, self.path,
                           type(exc).__name__, exc)
            return None

    def states(self, layer_name: str, kernel_names: list[str]) -> dict[str, Any] | None:
        """The layer's state per kernel, rebuilt from the file; None when the file lacks any."""
        if self.found is None:
            return None
        states = {}
        for name in kernel_names:
            prefix = f"{layer_name}{_SEP}{name}{_SEP}"
            tensors = []
            while (t := self._found(f"{prefix}{len(tensors)}")) is not None:
                tensors.append(t)
            try:
                if not tensors:
                    raise KeyError("no tensors")
                states[name] = self.kernels[name].restore(tensors)
            except Exception as exc:  # noqa: BLE001 - see _read
                self.missing += 1
                logger.warning("prepared layers (%s): %s lacks %s (%s: %s); preparing it, the file is written again",
                               self.what, self.path, layer_name, name, exc)
                return None
        self.read += 1
        return states

    def _found(self, name: str) -> torch.Tensor | None:
        return self.found.get(self.aliases.get(name, name))

    def keep(self, layer_name: str, states: dict[str, Any]) -> None:
        """A layer prepared here, to be written at `finish`."""
        for name, state in states.items():
            tensors = None if self.uncacheable else self.kernels[name].state_tensors(state)
            if tensors is None:
                if not self.uncacheable:
                    logger.info("prepared layers (%s): not cached: kernel %s keeps more than plain tensors "
                                "(prepared at every start)", self.what, name)
                self.uncacheable, self.new = True, {}
                return
            for i, t in enumerate(tensors):
                self._add(f"{layer_name}{_SEP}{name}{_SEP}{i}", t.detach().contiguous())

    def _add(self, name: str, t: torch.Tensor) -> None:
        """A tensor to write; one that another kernel's state holds too (int8's `int8pack` and
        `reference` keep the same codes) is written once, the other name an alias of it."""
        storage = t.untyped_storage().data_ptr()
        same = (storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if same in self._written:
            self.aliases[name] = self._written[same]
            return
        if storage in {s for s, *_ in self._written}:  # a part of another's bytes: its own copy
            t = t.clone()
        self._written[same] = name
        self.new[name] = t
        self.aliases.pop(name, None)  # (an alias the file had for it: the tensor itself now)

    def finish(self) -> None:
        """Logs what was read; writes the file when any layer was prepared here (then all of them are)."""
        if self.found is not None and not self.missing:
            logger.info("prepared layers (%s, %d): read from %s in %.2f s", self.what, self.read, self.path,
                        time.perf_counter() - self.start)
            return
        if not self.new or self.uncacheable:
            return
        if self.found is not None:  # a few layers missing: the others are in the file, rewrite it whole
            self.new = {**self.found, **self.new}
        try:
            _write_atomically(self.new, self.path, {"key": self.key, "format": FORMAT,
                                                    "aliases": json.dumps(self.aliases)})
        except Exception as exc:  # noqa: BLE001 - a full disk, a read-only folder: serving goes on uncached
            logger.warning("prepared layers (%s): cannot write %s (%s: %s); the next start prepares them again",
                           self.what, self.path, type(exc).__name__, exc)
            return
        logger.info("prepared layers (%s): written to %s", self.what, self.path)
        self.new = {}
        _remove_other_keys(self.path)


def _write_atomically(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str]) -> None:
    """To a temporary file in the same folder, then renamed: readers never see a partial file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache dir should stay readable
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _remove_other_keys(path: Path) -> None:
    """The files of the same slot under older keys (a checkpoint, torch or code changed since): a
    process that still maps one keeps reading it (POSIX)."""
    slot = path.name.rsplit("-", 1)[0]
    for other in path.parent.glob(f"{slot}-*.safetensors"):
        if other != path:
            other.unlink(missing_ok=True)
            logger.info("prepared layers: removed %s (an older key of the same slot)", other)
