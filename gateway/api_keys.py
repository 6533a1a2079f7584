"""Named API keys, stored as SHA-256 hashes, and each key's limits (a token-bucket request rate, a
bound on its requests in flight, a token budget) and its place among tenants (a priority class and a
fair-share weight).

The keys file (`--api-keys-file`, docs/gateway.md "API keys and limits", "Tenants"):

    {"keys": [{"name": "team-a", "sha256": "<hex of sha256(key)>",
               "requests_per_second": 5, "burst": 10, "max_concurrent": 4, "token_budget": 200000,
               "priority": 0, "weight": 2, "isolate_cache": true}, ...]}

`token_budget`: the tokens its requests in flight may hold together, each prompt + n x max_tokens
until it ends. `priority`: its requests' class where they name none, and the most urgent one they
may name (a lower value is more urgent; 0 by default). `weight`: its share of its class's work
against the other keys queued in that class (router/flow.py; 1 by default).

`isolate_cache`: the key's requests share prefix-cache blocks only with its own (their cache salt
starts with the key's name: `cache_salt`, engine/core/request.py), so another key cannot time them.

Only hashes are stored, so the file (a ConfigMap, a repository) does not leak the keys; a
presented bearer token is hashed and compared with every stored hash in constant time. The limits
are held cluster-wide in Redis where the gateway has one, else per gateway process (gateway/limits.py).
Who a request is and whether its key may start it are decided at the door (gateway/guard.py
`APIKeyManager`); its token budget once its prompt is tokenized (gateway/app.py).

The file is re-read when it changes (`KeysFileWatcher`: its inode, mtime or size, polled; or at once
on SIGHUP), so keys rotate without a restart: a Kubernetes Secret volume swaps a symlink to a new
copy, which is a new inode. A new file that does not parse keeps the keys in use (one log line).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

from engine.core.request import MAX_PRIORITY

logger = logging.getLogger(__name__)
DEFAULT_KEY_NAME = "default"  # the name of the single `--api-key` / $PDSERVE_API_KEY
NO_KEY = "_none"  # the metrics label of a request without a (valid) key; no key name can take it
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_ENTRY_FIELDS = {"name", "sha256", "requests_per_second", "burst", "max_concurrent", "isolate_cache", "token_budget",
                 "priority", "weight"}
KEYS_POLL_S = 2.0  # how often KeysFileWatcher looks at the file (a stat)
MIN_KEY_CHARS = 16  # what `pdserve hash-api-key` and --api-key take: 16 random hex digits are 64 bits


def hash_api_key(key: str) -> str:
    """The hex SHA-256 of a key: what the keys file stores (`pdserve hash-api-key`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_key_strength(key: str, where: str) -> None:
    """ValueError (one line, naming `where`, never the key) for a key no HTTP client could send
    (whitespace, not printable ASCII) or shorter than MIN_KEY_CHARS. Only a key seen in plain text
    can be checked: a keys file holds hashes, so its keys are checked when `pdserve hash-api-key`
    makes them."""
    if any(c.isspace() for c in key):  # a bearer token has none: its hash would never match
        raise ValueError(f"{where}: the key holds whitespace (give one key, on one line)")
    if not (key.isascii() and key.isprintable()):  # an HTTP header carries no other
        raise ValueError(f"{where}: the key must be printable ASCII")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{where}: the key has {len(key)} characters, fewer than {MIN_KEY_CHARS}: make one with "
                         "`openssl rand -hex 32`")


@dataclass(frozen=True)
class APIKey:
    """One named key: its hash and its limits (None: unlimited)."""

    name: str
    sha256: str
    requests_per_second: float | None = None
    burst: int | None = None  # bucket size; None with a rate: the rate rounded up (at least 1)
    max_concurrent: int | None = None
    isolate_cache: bool = False  # its requests' cache salt starts with its name (`cache_salt`)
    token_budget: int | None = None  # tokens its requests in flight may hold (prompt + n x max_tokens each)
    priority: int = 0  # its requests' default class, and the most urgent they may ask for
    weight: float = 1.0  # its fair share within a class (router/flow.py)

    @property
    def limited(self) -> bool:
        """Whether any limit applies to it (else no limit is looked up for its requests)."""
        return self.requests_per_second is not None or self.max_concurrent is not None or self.token_budget is not None

    def __post_init__(self):
        assert KEY_NAME.fullmatch(self.name) and _SHA256_HEX.fullmatch(self.sha256), self.name
        assert self.burst is None or self.requests_per_second is not None, self.name

    @property
    def cache_salt(self) -> str | None:
        """What its requests' cache salts start with (isolate_cache), or None."""
        return f"key:{self.name}" if self.isolate_cache else None

    @property
    def bucket_size(self) -> int:
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.requests_per_second or 1))


def _number(entry: dict, field: str, where: str, integer: bool) -> float | int | None:
    """An optional positive number of a key entry; ValueError naming it otherwise."""
    value = entry.get(field)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or value <= 0:
        kind = "an integer >= 1" if integer else "a number > 0"
        raise ValueError(f"{where}.{field} must be {kind} or absent, got {json.dumps(value)}")
    return value


def _parse_entry(entry, where: str) -> APIKey:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object, got {json.dumps(entry)}")
    if unknown := sorted(set(entry) - _ENTRY_FIELDS):
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(_ENTRY_FIELDS))}")
    name, digest = entry.get("name"), entry.get("sha256")
    if not isinstance(name, str) or not KEY_NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be 1-63 of [A-Za-z0-9_.-], starting alphanumeric, got {json.dumps(name)}")
    if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.lower()):
        raise ValueError(f"{where}.sha256 must be 64 hex digits, the SHA-256 of the key (`pdserve hash-api-key` "
                         "prints it), never the key itself")
    rate = _number(entry, "requests_per_second", where, integer=False)
    burst = _number(entry, "burst", where, integer=True)
    if burst is not None and rate is None:
        raise ValueError(f"{where}.burst needs requests_per_second (it is the size of the rate's bucket)")
    isolate = entry.get("isolate_cache", False)
    if not isinstance(isolate, bool):
        raise ValueError(f"{where}.isolate_cache must be true or false, got {json.dumps(isolate)}")
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise ValueError(f"{where}.priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}], "
                         f"got {json.dumps(priority)}")
    weight = _number(entry, "weight", where, integer=False)
    return APIKey(name, digest.lower(), None if rate is None else float(rate), burst,
                  _number(entry, "max_concurrent", where, integer=True), isolate,
                  _number(entry, "token_budget", where, integer=True), priority,
                  1.0 if weight is None else float(weight))


def load_api_keys(path: str | Path) -> list[APIKey]:
    """The keys of a keys file. Raises ValueError, one line naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"api_keys_file {path}: cannot read it: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_keys_file {path}: not JSON: {exc}") from None
    try:
        if not isinstance(data, dict) or set(data) != {"keys"} or not isinstance(data["keys"], list):
            raise ValueError('expected an object {"keys": [...]} and nothing else')
        if not data["keys"]:
            raise ValueError("keys is empty: give at least one key (without keys the API is open)")
        keys = [_parse_entry(entry, f"keys[{i}]") for i, entry in enumerate(data["keys"])]
        check_unique_keys(keys)
    except ValueError as exc:
        raise ValueError(f"api_keys_file {path}: {exc}") from None
    return keys


def check_unique_keys(keys: Iterable[APIKey]) -> None:
    names, hashes = set(), set()
    for key in keys:
        if key.name in names:
            raise ValueError(f"the key name {key.name!r} is given twice")
        if key.sha256 in hashes:  # one key under two names: which one's limits would apply?
            raise ValueError(f"the key named {key.name!r} has the same hash as an earlier one")
        names.add(key.name)
        hashes.add(key.sha256)


def configured_keys(api_key: str | None, api_keys_file: str | None) -> list[APIKey]:
    """The keys a gateway checks: the file's, plus the single `api_key` (or $PDSERVE_API_KEY,
    read by the caller) as one unlimited key named "default". Raises ValueError, one line."""
    keys = [] if api_key is None else [APIKey(DEFAULT_KEY_NAME, hash_api_key(api_key))]
    return keys if api_keys_file is None else _with_file(api_keys_file, keys)


def _with_file(api_keys_file: str, fixed: Iterable[APIKey]) -> list[APIKey]:
    """The file's keys, then `fixed` (the "default" key); ValueError (one line) as configured_keys."""
    keys = [*load_api_keys(api_keys_file), *fixed]
    try:
        check_unique_keys(keys)
    except ValueError as exc:
        raise ValueError(f"api_keys_file {api_keys_file} and --api-key/$PDSERVE_API_KEY: {exc}") from None
    return keys


class KeyHolder(Protocol):
    """What a KeysFileWatcher reads and replaces the keys of (gateway/guard.py APIKeyManager)."""
    keys: tuple[APIKey, ...]

    def replace(self, keys: Iterable[APIKey]) -> None: ...


class KeysFileWatcher:
    """Re-reads a keys file into an `APIKeyManager` when it changes, on a daemon thread.

    Properties: a change of the file (its inode, as when a Kubernetes Secret volume swaps its
    symlink, its mtime or its size) is picked up within `interval_s`, or at once after
    `reload_soon()` (SIGHUP). The file's keys plus `fixed` (the --api-key "default") replace the
    manager's in one step, logged with the keys' names only. A file that cannot be read or
    parsed, or clashes with `fixed`, changes nothing and is logged once per version of the file.
    """

    def __init__(self, path: str | Path, manager: KeyHolder, fixed: Iterable[APIKey] = (),
                 interval_s: float = KEYS_POLL_S):
        self.path, self.manager, self.fixed, self.interval_s = str(path), manager, tuple(fixed), interval_s
        self._version = self._stat()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)  # follows the symlinks: a swapped ..data link is a new inode
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def start(self) -> KeysFileWatcher:
        self._thread = threading.Thread(target=self._run, daemon=True, name="api-keys-file")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def reload_soon(self) -> None:
        """Re-read the file now, changed or not. Safe in a signal handler (it only sets an event)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            forced = self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check(force=forced)
            except Exception:  # never the end of reloading: the next change is tried again
                logger.exception("API keys file %s: reload failed", self.path)

    def check(self, force: bool = False) -> bool:
        """Reloads if the file changed since the last look (or `force`); True when new keys are in place."""
        version = self._stat()
        if version == self._version and not force:
            return False
        self._version = version
        old = {k.name: k for k in self.manager.keys}
        try:
            keys = _with_file(self.path, self.fixed)
            self.manager.replace(keys)
        except ValueError as exc:
            logger.error("API keys not reloaded (the %d in use stay): %s", len(old), exc)
            return False
        new = {k.name: k for k in keys}
        changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
        logger.info("API keys reloaded from %s: %d keys; added %s; removed %s; changed %s", self.path, len(new),
                    ", ".join(sorted(set(new) - set(old))) or "none", ", ".join(sorted(set(old) - set(new))) or "none",
                    ", ".join(changed) or "none")
        return True
