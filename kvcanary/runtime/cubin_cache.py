"""On-disk cache of compiled cubins.

Key: sha256 over labelled fields that name every input of a compile (schema, kvcanary version,
NVRTC version, arch, kernel family, sorted options, prelude and every byte of the kernels_src files
the family's program reads: its .cu and the .cuh headers). Entries are written to a
same-directory temp file and moved into place with ``os.replace`` (atomic, no locks; concurrent
writers of one key write identical bytes). Each entry carries the sha256 of its payload, so a
truncated or corrupt entry is a miss, never a wrong cubin. An unwritable directory falls back to
memory with one warning. Environment: ``KVCANARY_CACHE_DIR`` (directory), ``KVCANARY_CACHE=0``
(disable the disk cache).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

SCHEMA = "kvcanary-cubin-cache/1"
_MAGIC = b"KVCCUBIN1\n"


def cache_key(**fields: object) -> str:
    """sha256 of labelled fields; bytes are hashed raw, everything else as its repr."""
    h = hashlib.sha256()
    for name in sorted(fields):
        value = fields[name]
        data = value if isinstance(value, bytes) else repr(value).encode()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def default_dir() -> Path | None:
    """The cache directory from the environment, or None when the disk cache is disabled."""
    if os.environ.get("KVCANARY_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get("KVCANARY_CACHE_DIR"):
        return Path(os.environ["KVCANARY_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvcanary"


class CubinCache:
    """get/put of payloads by key; in-memory only when ``directory`` is None or unwritable."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.memory: dict[str, bytes] = {}
        self.hits = self.misses = 0
        self._warned = False

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{key}.cubin"

    def get(self, key: str) -> bytes | None:
        payload = self.memory.get(key)
        if payload is None and self.directory is not None:
            payload = self._read(self._path(key))
        if payload is None:
            self.misses += 1
        else:
            self.hits += 1
            self.memory[key] = payload
        return payload

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        head = len(_MAGIC) + 32
        if len(blob) < head or not blob.startswith(_MAGIC):
            return None
        digest, payload = blob[len(_MAGIC):head], blob[head:]
        return payload if hashlib.sha256(payload).digest() == digest else None

    def put(self, key: str, payload: bytes) -> None:
        self.memory[key] = payload
        if self.directory is None:
            return
        blob = _MAGIC + hashlib.sha256(payload).digest() + payload
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key[:16]}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self._path(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            if not self._warned:
                warnings.warn(f"kv-canary: compile cache directory {self.directory} is not writable "
                              f"({exc}); keeping compiled kernels in memory for this process. Fix: "
                              f"set KVCANARY_CACHE_DIR to a writable directory, or KVCANARY_CACHE=0 "
                              f"to silence this.", RuntimeWarning, stacklevel=3)
                self._warned = True
            self.directory = None
