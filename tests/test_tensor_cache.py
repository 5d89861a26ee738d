"""The tensor cache (document states, prepared weights): entries round-trip, and any damage to a file is caught by
its checksum before the file is used."""

import pytest
import torch

from indexpool.model.tensor_cache import CHECKSUM_CHUNK_WORDS, TensorCache, file_checksum

CHUNK_BYTES = CHECKSUM_CHUNK_WORDS * 8


@pytest.fixture
def saved(tmp_path):
    cache = TensorCache(tmp_path)
    state = {"k": torch.randn(3, CHUNK_BYTES // 4 + 7), "v": torch.arange(11, dtype=torch.int8)}  # odd sizes
    path = cache.save("abc", [1, 2, 3], state, "a test entry")
    return cache, path, state


def test_an_entry_round_trips(saved):
    cache, path, state = saved
    tokens, loaded = cache.load("abc", pytest.fail)
    assert tokens == [1, 2, 3] and loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert path.name.split(".")[1] == file_checksum(path)


def damage_flip(data: bytearray) -> None:
    data[len(data) // 2] ^= 0x10


def damage_last_byte(data: bytearray) -> None:
    data[-1] ^= 0x01


def damage_swap_chunks(data: bytearray) -> None:
    start = len(data) - 2 * CHUNK_BYTES - 5
    first, second = data[start : start + CHUNK_BYTES], data[start + CHUNK_BYTES : start + 2 * CHUNK_BYTES]
    data[start : start + 2 * CHUNK_BYTES] = second + first


def damage_truncate(data: bytearray) -> None:
    del data[-100:]


@pytest.mark.parametrize("damage", [damage_flip, damage_last_byte, damage_swap_chunks, damage_truncate])
def test_damage_is_detected_and_the_entry_deleted(saved, damage):
    cache, path, _ = saved
    data = bytearray(path.read_bytes())
    before = bytes(data)
    damage(data)
    assert bytes(data) != before
    path.write_bytes(bytes(data))
    warnings = []
    assert cache.load("abc", warnings.append) is None
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0]
    assert not path.exists()


def test_checksum_of_small_and_empty_files(tmp_path):
    sums = set()
    for content in (b"", b"\x00", b"\x00\x00", b"\x01", b"\x00" * 9, b"\x01" + b"\x00" * 8):
        path = tmp_path / "f"
        path.write_bytes(content)
        sums.add(file_checksum(path))
    assert len(sums) == 6
