"""A directory of tensor files kept between runs: the document cache (a read document's cache state, so the next
question on it starts at once) and prepared model weights (dequantized and quantized for decode, so a model loads
in a second).

One safetensors file per entry, named `<key>.<crc32>.safetensors`: the key is a hash of everything that shapes the
entry (for a document: model, attention settings, the prompt tokens up to the end of the document); the crc32 of
the file's bytes is in the name, so a truncated or corrupted file is detected before it is used. Files are written
to a temporary name and renamed (atomic on POSIX); reading an entry touches its mtime, and the least recently used
entries are evicted when the directory grows past its size limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 1
DEFAULT_LIMIT_BYTES = 8 * 1024**3
SUFFIX = ".safetensors"


def default_cache_dir(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "indexpool" / kind


def cache_key(identity: dict, tokens: list[int] = ()) -> str:
    """A hex key for an entry: `identity` (what shaped it, JSON-able) and, for a document, the tokens it holds."""
    digest = hashlib.sha256(json.dumps({"version": FORMAT_VERSION, **identity}, sort_keys=True).encode())
    digest.update(torch.tensor(list(tokens), dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()[:32]


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass
class CacheEntry:
    path: Path
    key: str
    size: int
    last_used: float
    description: str  # what is cached: a document's name(s) and token count, a model's name


class TensorCache:
    def __init__(self, directory: Path, limit_bytes: int = DEFAULT_LIMIT_BYTES):
        self.directory = Path(directory)
        self.limit_bytes = limit_bytes

    def entries(self) -> list[CacheEntry]:
        """Entries, most recently used first (unreadable ones are listed with their file name)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
                with safe_open(str(path), "pt") as f:
                    description = (f.metadata() or {}).get("description", "?")
            except Exception:  # a damaged file: still listed, so `cache clear` can be trusted to find it
                stat, description = path.stat(), "(unreadable)"
            found.append(CacheEntry(path, path.name.split(".")[0], stat.st_size, stat.st_mtime, description))
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    def load(self, key: str, warn) -> tuple[list[int], dict[str, torch.Tensor]] | None:
        """The tokens and state saved under `key`, or None. A damaged entry is deleted with a warning."""
        for path in sorted(self.directory.glob(f"{key}.*{SUFFIX}")) if self.directory.is_dir() else []:
            try:
                expected_crc = int(path.name.split(".")[1], 16)
                if _file_crc(path) != expected_crc:
                    raise ValueError("checksum mismatch (truncated or corrupted)")
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if int(meta.get("version", -1)) != FORMAT_VERSION:
                        raise ValueError(f"format version {meta.get('version')} (expected {FORMAT_VERSION})")
                    state = {name: f.get_tensor(name) for name in f.keys()}
                tokens = state.pop("tokens").tolist()
            except Exception as e:
                warn(f"cache entry {path.name} is unusable ({e}); building it again")
                path.unlink(missing_ok=True)
                continue
            os.utime(path)  # mark as recently used
            return tokens, state
        return None

    def save(self, key: str, tokens: list[int], state: dict[str, torch.Tensor], description: str) -> Path:
        """Write an entry atomically, then evict the least recently used ones beyond the size limit."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in state.items()}
        tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"version": str(FORMAT_VERSION), "description": description,
                                              "created": str(int(time.time()))})
            final = self.directory / f"{key}.{_file_crc(Path(tmp)):08x}{SUFFIX}"
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for old in self.directory.glob(f"{key}.*{SUFFIX}"):  # an older copy under another checksum
            if old != final:
                old.unlink(missing_ok=True)
        self.evict(keep=final)
        return final

    def evict(self, keep: Path | None = None) -> list[CacheEntry]:
        """Delete least recently used entries until the total is within the limit; returns what was deleted."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed = []
        for entry in reversed(entries):  # oldest first
            if total <= self.limit_bytes:
                break
            if entry.path == keep:
                continue
            entry.path.unlink(missing_ok=True)
            total -= entry.size
            removed.append(entry)
        return removed

    def clear(self) -> int:
        """Delete every entry (and stray temporary files); returns the bytes freed."""
        freed = 0
        if self.directory.is_dir():
            for path in [*self.directory.glob(f"*{SUFFIX}"), *self.directory.glob(".*.tmp")]:
                freed += path.stat().st_size
                path.unlink(missing_ok=True)
        return freed
