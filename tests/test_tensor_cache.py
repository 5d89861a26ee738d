"""The tensor cache (document states, prepared weights) and the result cache: entries round-trip; any damage to a
file, down to one flipped bit, is caught by its checksum before the file is used; interrupted saves are cleaned up;
`clear` deletes only what the cache wrote, in a directory it made."""

import os
import subprocess
import sys

import pytest
import torch

from indexpool.jobs import JobResult, ResultCache
from indexpool.model.errors import SettingsError
from indexpool.model.tensor_cache import (TAG_NAME, TensorCache, cache_key, file_checksum, orphaned_temporaries,
                                          temporary_file)

KEY = cache_key({"test": "entry"})
CHUNK = 1 << 20


@pytest.fixture
def saved(tmp_path):
    cache = TensorCache(tmp_path / "cache")
    state = {"k": torch.randn(3, CHUNK // 4 + 7), "v": torch.arange(11, dtype=torch.int8)}  # odd sizes
    path = cache.save(KEY, [1, 2, 3], state, "a test entry")
    return cache, path, state


def test_an_entry_round_trips(saved):
    cache, path, state = saved
    tokens, loaded = cache.load(KEY, pytest.fail)
    assert tokens == [1, 2, 3] and loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert path.name.split(".")[1] == file_checksum(path)
    assert (path.parent / TAG_NAME).read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")


def flip_bit(offset_of_size, bit):
    def damage(data: bytearray) -> None:
        data[offset_of_size(len(data))] ^= 1 << bit
    damage.__name__ = f"flip_bit_{bit}"
    return damage


def damage_cancelling_flips(data: bytearray) -> None:
    """+2**62 in one 64-bit word, -2**62 in the next: a sum of words per chunk kept its value."""
    at = len(data) // 2 // 8 * 8
    first = int.from_bytes(data[at:at + 8], "little")
    second = int.from_bytes(data[at + 8:at + 16], "little")
    data[at:at + 8] = ((first + (1 << 62)) % 2**64).to_bytes(8, "little")
    data[at + 8:at + 16] = ((second - (1 << 62)) % 2**64).to_bytes(8, "little")


def damage_swap_chunks(data: bytearray) -> None:
    start = len(data) - 2 * CHUNK - 5
    first, second = data[start: start + CHUNK], data[start + CHUNK: start + 2 * CHUNK]
    data[start: start + 2 * CHUNK] = second + first


def damage_truncate(data: bytearray) -> None:
    del data[-100:]


@pytest.mark.parametrize("damage", [
    flip_bit(lambda n: 0, 0), flip_bit(lambda n: 9, 3), flip_bit(lambda n: n // 3, 7), flip_bit(lambda n: n // 2, 4),
    flip_bit(lambda n: n - 1, 0), damage_cancelling_flips, damage_swap_chunks, damage_truncate])
def test_damage_is_detected_and_the_entry_deleted(saved, damage):
    cache, path, _ = saved
    data = bytearray(path.read_bytes())
    before = bytes(data)
    damage(data)
    assert bytes(data) != before
    path.write_bytes(bytes(data))
    warnings = []
    assert cache.load(KEY, warnings.append) is None
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0]
    assert not path.exists()


def test_checksum_of_small_and_empty_files(tmp_path):
    sums = set()
    for content in (b"", b"\x00", b"\x00\x00", b"\x01", b"\x00" * 9, b"\x01" + b"\x00" * 8):
        path = tmp_path / "f"
        path.write_bytes(content)
        sums.add(file_checksum(path))
    assert len(sums) == 6


def test_an_interrupted_save_is_removed_by_the_next_cache_user(tmp_path):
    directory = tmp_path / "cache"
    TensorCache(directory).save(KEY, [], {"x": torch.zeros(4)}, "first")
    # A writer killed half-way: its temporary file stays, named with its (now gone) process id.
    writer = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = directory / f".indexpool.{writer.stdout.strip()}.abc123_x.tmp"
    orphan.write_bytes(b"\0" * 1000)
    with temporary_file(directory) as live:  # a save in progress in this (live) process
        assert orphaned_temporaries(directory) == [orphan]
        assert TensorCache(directory).load(KEY, pytest.fail) is not None
        assert not orphan.exists() and live.exists()


def test_clear_deletes_only_what_the_cache_wrote(saved):
    cache, path, _ = saved
    foreign = [cache.directory / "settings.json", cache.directory / "weights.safetensors",
               cache.directory / f"{KEY}.safetensors", cache.directory / "notes.tmp"]
    for other in foreign:
        other.write_text("the user's")
    results = ResultCache(cache.directory / "remote-results")
    results.put(KEY, JobResult(text="an answer"))
    (cache.directory / "remote-results" / "mine.json").write_text("{}")
    freed = cache.clear() + results.clear()
    assert freed > 0 and not path.exists() and results.get(KEY) is None
    assert all(other.read_text() == "the user's" for other in foreign)
    assert (cache.directory / "remote-results" / "mine.json").exists()


def test_clear_refuses_a_directory_the_cache_did_not_make(tmp_path):
    (tmp_path / "a.safetensors").write_text("x")
    (tmp_path / f"{KEY}.{'0' * 32}.safetensors").write_text("named like an entry")
    with pytest.raises(SettingsError, match="not a cache directory"):
        TensorCache(tmp_path).clear()
    assert len(os.listdir(tmp_path)) == 2


def test_an_old_untagged_cache_is_adopted_but_a_folder_of_user_files_is_not(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / f"{KEY}.{'0' * 16}.safetensors").write_bytes(b"format 2")
    TensorCache(old).save(cache_key({"other": 1}), [], {"x": torch.zeros(1)}, "new")
    assert (old / TAG_NAME).exists()
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.txt").write_text("mine")
    TensorCache(users).save(KEY, [], {"x": torch.zeros(1)}, "new")
    assert not (users / TAG_NAME).exists()


def test_a_result_with_a_flipped_bit_is_not_served(tmp_path):
    results = ResultCache(tmp_path)
    results.put(KEY, JobResult(text="the answer is 42"))
    assert results.get(KEY).text == "the answer is 42"
    path = tmp_path / f"{KEY}.json"
    data = bytearray(path.read_bytes())
    data[data.index(b"42")] ^= 0x01  # "the answer is 52": still valid JSON
    path.write_bytes(bytes(data))
    assert results.get(KEY) is None and not path.exists()
