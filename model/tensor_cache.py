"""A directory of tensor files kept between runs: the document cache (a read document's cache state, so the next
question on it starts at once) and prepared model weights (dequantized and quantized for decode, so a model loads
in a second).

What the cache promises:
- Integrity: one safetensors file per entry, named `<key>.<checksum>.safetensors`. The key is a hash of everything
  that shapes the entry (for a document: model, attention settings, the prompt tokens up to the end of the
  document); the checksum is XXH3-128 of the whole file (`file_checksum`), checked on every load, so a truncated
  file or a single flipped bit is caught before the entry is used: it is deleted with a warning and rebuilt.
- Atomicity: an entry is written to a temporary name holding the writer's process id and renamed (atomic on POSIX),
  so readers see a whole entry or none. A save killed half-way leaves its temporary file; the next cache user
  removes those whose writer is gone (`cache list` counts them).
- Ownership: a directory the cache creates gets a `CACHEDIR.TAG` (the Cache Directory Tagging standard, so backup
  tools skip it). `clear` and eviction delete only files named as the cache names them, and `clear` only in a
  tagged directory: pointing `--cache-dir` at a folder of one's own files deletes nothing in it.
- Size: reading an entry touches its mtime; the least recently used entries are evicted past the size limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import SettingsError

FORMAT_VERSION = 3  # 3: XXH3-128 of the file in the name (2 had a 64-bit sum, which some bit flips kept)
DEFAULT_LIMIT_BYTES = 8 * 1024**3
SUFFIX = ".safetensors"
TAG_NAME = "CACHEDIR.TAG"
TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
            "# This directory is a cache written by indexpool; see https://bford.info/cachedir/\n")
ENTRY_NAME = re.compile(r"[0-9a-f]{32}\.([0-9a-f]{16}|[0-9a-f]{32})\.safetensors")  # 16 digits: format 2
# `.indexpool.<pid>.<random>.tmp`; format 2 wrote `.<key>.<random>.tmp`, without the writer's process id.
TEMPORARY_NAME = re.compile(r"\.(?:indexpool\.(\d+)|[0-9a-f]{32})\.[a-z0-9_]+\.tmp")
ORPHAN_SECONDS = 24 * 3600  # a temporary file this old is an orphan even if its process id is in use again


def cache_key(identity: dict, tokens: list[int] = ()) -> str:
    """A hex key for an entry: `identity` (what shaped it, JSON-able) and, for a document, the tokens it holds."""
    digest = hashlib.sha256(json.dumps({"version": FORMAT_VERSION, **identity}, sort_keys=True).encode())
    digest.update(torch.tensor(list(tokens), dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()[:32]


def file_checksum(path: Path) -> str:
    """32 hex digits: XXH3-128 of the file's bytes, read memory-mapped. Any changed, missing or moved byte changes
    it (but for a 2**-128 chance); it runs at memory speed, so checking a GB-sized entry on each load costs little."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                digest.update(data)
    return digest.hexdigest()


def bytes_checksum(data: bytes) -> str:
    """`file_checksum` of a file holding `data`."""
    return xxhash.xxh3_128_hexdigest(data)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, under another user
        return False
    return False


def orphaned_temporaries(directory: Path) -> list[Path]:
    """Temporary files of saves that will not finish: their writer has exited (or they are over a day old)."""
    found = []
    for path in directory.glob(".*.tmp") if directory.is_dir() else []:
        match = TEMPORARY_NAME.fullmatch(path.name)
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            continue
        if match and (age > ORPHAN_SECONDS or (match[1] is not None and _process_gone(int(match[1])))
                      or (match[1] is None and age > 3600)):
            found.append(path)
    return found


def delete_files(paths) -> int:
    """Delete `paths` (one already gone or not deletable is passed over); returns the bytes freed."""
    freed = 0
    for path in paths:
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except OSError:
            pass
    return freed


def remove_orphaned_temporaries(directory: Path) -> int:
    """Delete `orphaned_temporaries`; returns the bytes freed."""
    return delete_files(orphaned_temporaries(directory))


def make_cache_directory(directory: Path) -> None:
    """Create `directory` tagged as a cache; tag an existing one only when every file in it is the cache's own (a
    cache written before the tag existed), never a folder holding the user's files."""
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
    elif (directory / TAG_NAME).exists() or any(
            path.is_file() and not (ENTRY_NAME.fullmatch(path.name) or TEMPORARY_NAME.fullmatch(path.name))
            for path in directory.iterdir()):
        return
    tagged = directory / TAG_NAME
    if not tagged.exists():
        write_atomically(tagged, TAG_TEXT.encode())


def is_cache_directory(directory: Path) -> bool:
    return (directory / TAG_NAME).is_file()


@contextlib.contextmanager
def temporary_file(directory: Path) -> Iterator[Path]:
    """An empty file in `directory`, named so that `orphaned_temporaries` knows its writer; removed on leaving
    unless the caller renamed it into place."""
    fd, name = tempfile.mkstemp(prefix=f".indexpool.{os.getpid()}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def write_atomically(final: Path, data: bytes) -> None:
    with temporary_file(final.parent) as tmp:
        tmp.write_bytes(data)
        os.replace(tmp, final)


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
        self._swept = False

    def _sweep(self) -> None:
        """Once per cache user: remove the temporary files that interrupted saves left."""
        if not self._swept:
            self._swept = True
            remove_orphaned_temporaries(self.directory)

    def _files(self) -> list[Path]:
        return [path for path in self.directory.glob(f"*{SUFFIX}") if ENTRY_NAME.fullmatch(path.name)] \
            if self.directory.is_dir() else []

    def entries(self) -> list[CacheEntry]:
        """Entries, most recently used first (unreadable ones are listed with their file name)."""
        found = []
        for path in self._files():
            try:
                stat = path.stat()
            except OSError:  # deleted meanwhile by another cache user
                continue
            try:
                with safe_open(str(path), "pt") as f:
                    description = (f.metadata() or {}).get("description", "?")
            except Exception:  # a damaged file: still listed, so `cache clear` can be trusted to find it
                description = "(unreadable)"
            found.append(CacheEntry(path, path.name.split(".")[0], stat.st_size, stat.st_mtime, description))
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    def load(self, key: str, warn) -> tuple[list[int], dict[str, torch.Tensor]] | None:
        """The tokens and state saved under `key`, or None. A damaged entry is deleted with a warning."""
        self._sweep()
        for path in [p for p in self._files() if p.name.startswith(f"{key}.")]:
            try:
                checksum = path.name.split(".")[1]
                if len(checksum) != 32:
                    raise ValueError("written by an older version")
                if file_checksum(path) != checksum:
                    raise ValueError("checksum mismatch: truncated or corrupted")
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("version") != str(FORMAT_VERSION):
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
        if not re.fullmatch(r"[0-9a-f]{32}", key):
            raise ValueError(f"a cache key is 32 hex digits (cache_key), not {key!r}")
        make_cache_directory(self.directory)
        self._sweep()
        tensors = {name: t.contiguous() for name, t in state.items()}
        tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
        with temporary_file(self.directory) as tmp:
            save_file(tensors, str(tmp), metadata={"version": str(FORMAT_VERSION), "description": description,
                                                   "created": str(int(time.time()))})
            final = self.directory / f"{key}.{file_checksum(tmp)}{SUFFIX}"
            os.replace(tmp, final)
        for old in self._files():  # an older copy under another checksum
            if old.name.startswith(f"{key}.") and old != final:
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
        """Delete every entry and orphaned temporary file; returns the bytes freed. Files the cache did not name
        stay, and a directory without the cache's tag is refused (SettingsError): it is not a cache."""
        if not self.directory.is_dir():
            return 0
        if not is_cache_directory(self.directory):
            raise SettingsError(f"{self.directory} is not a cache directory indexpool made (no {TAG_NAME} in it); "
                                "nothing deleted")
        return remove_orphaned_temporaries(self.directory) + delete_files(self._files())
