"""The `indexpool` command on a glm5_next checkpoint, as a user runs it: a subprocess of the console script on a
tiny random GLM-5.3-Flash directory built at test time (`tests/tiny_glm5_next.py`, with its tokenizer, chat
template and generation config). The model's own DSA attention serves every command; `info` describes its cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.test_cli import assert_error, indexpool, ok
from tests.tiny_glm5_next import TINY_TEXT, build_checkpoint

GREEDY = ["--temperature", "0", "--dtype", "fp32", "--quiet"]
STOP_REASONS = {"stop_token", "max_new_tokens", "context_full"}
PROMPT = "The indexer keeps the best pools"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next_cli")
    build_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from indexpool.model.runtime import load_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_engine(str(checkpoint), "fp32")
    torch.set_num_threads(threads)  # the tests after this module's get the threads they had


def greedy_text(loaded, ids: list[int], max_new_tokens: int) -> tuple[str, int]:
    """What the engine generates in-process for `ids` (greedy, stopping on the end tokens): text, new tokens."""
    from indexpool.model.generate import Sampler, SamplingParams, Session

    session = Session(loaded.model, len(ids) + max_new_tokens)
    tokens = list(session.generate(ids, Sampler(SamplingParams(temperature=0)), max_new_tokens,
                                   loaded.tokenizer.stop_ids))
    decoder = loaded.tokenizer.stream_decoder()
    return "".join(decoder.push(t) for t in tokens) + decoder.flush(), len(tokens)


# ------------------------------------------------------------------------------------------------------ info

def test_info_describes_the_model_and_its_cache(checkpoint):
    facts = json.loads(ok(indexpool("info", "--model", str(checkpoint), "--dtype", "fp32", "--json",
                                    "--tokens", "1K,4096")))
    c = TINY_TEXT
    assert facts["architecture"] == "glm5_next" and facts["dtype"] == "float32"
    assert (facts["layers"], facts["kda_layers"], facts["mla_layers"], facts["indexer_layers"]) == (4, 2, 2, 1)
    assert facts["context_length"] == c["max_position_embeddings"] and facts["mtp_layers"] == 1
    # Per token: the fp32 latent of the 2 MLA layers; one pooled key (bf16, or fp8 + a 4-byte scale) per kpool
    # tokens of the one indexer layer.
    assert facts["mla_latent_bytes_per_token"] == 2 * c["kv_lora_rank"] * 4
    assert facts["pooled_index_bf16_bytes_per_token"] == c["index_head_dim"] * 2 / c["index_kpool"]
    assert facts["pooled_index_fp8_bytes_per_token"] == (c["index_head_dim"] + 4) / c["index_kpool"]
    # Per sequence: 2 KDA layers' fp32 states and conv windows (K-1 rows of q, k and v), and the indexer tail's
    # raw keys and gate logits (kpool-1 rows, fp32).
    heads, head_dim = c["linear_num_heads"], c["linear_head_dim"]
    kda = 2 * (heads * head_dim**2 * 4 + (c["linear_conv_kernel_dim"] - 1) * 3 * heads * head_dim * 4)
    tails = 2 * (c["index_kpool"] - 1) * c["index_head_dim"] * 4  # keys and gate logits
    assert facts["fixed_state_bytes"] == kda + tails
    assert set(facts["cache_bytes"]) == {"1024", "4096"}
    for n, row in facts["cache_bytes"].items():
        n = int(n)
        assert row["mla_latent"] == n * facts["mla_latent_bytes_per_token"]
        assert row["pooled_index"] == n * facts["pooled_index_bf16_bytes_per_token"]
        assert row["total"] == row["mla_latent"] + row["pooled_index"] + facts["fixed_state_bytes"]
    assert any("vision tower" in note for note in facts["notes"])


def test_info_text_lists_the_cache_table_and_notes(checkpoint):
    lines = ok(indexpool("info", "--model", str(checkpoint))).splitlines()
    assert any(line.startswith("architecture") and line.endswith("glm5_next") for line in lines)
    assert sum(line.startswith(("cache at 131,072 tokens", "cache at 1,048,576 tokens")) for line in lines) == 2
    assert any(line.startswith("note") and "vision tower" in line for line in lines)


def released_config() -> dict:
    """GLM-5.3-Flash's text config as SPEC section 2 gives it, in the released (nested) layout."""
    return {"model_type": "glm5_next", "text_config": {
        "model_type": "glm5_next_text", "hidden_size": 4096, "vocab_size": 154880, "num_hidden_layers": 45,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "v_head_dim": 256, "index_n_heads": 32,
        "index_head_dim": 128, "index_kpool": 4, "index_topk": 2048, "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 1,
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4}}}


def test_info_config_sizes_the_released_cache_without_weights(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(released_config()))
    facts = json.loads(ok(indexpool("info", "--config", str(tmp_path), "--json")))  # the folder, or the file
    assert facts == json.loads(ok(indexpool("info", "--config", str(config), "--json"))) | {"config": str(tmp_path)}
    assert (facts["layers"], facts["kda_layers"], facts["mla_layers"]) == (45, 34, 11)
    assert facts["cache_dtype"] == "bfloat16" and facts["context_length"] == 1 << 20
    # 11 MLA layers x 512-wide bf16 latent; 11 indexers x one 128-wide pooled key per 4 tokens.
    assert facts["mla_latent_bytes_per_token"] == 11 * 512 * 2
    assert facts["pooled_index_bf16_bytes_per_token"] == 11 * 128 * 2 / 4
    assert facts["pooled_index_fp8_bytes_per_token"] == 11 * (128 + 4) / 4
    assert set(facts["cache_bytes"]) == {str(128 * 1024), str(1 << 20)}  # the default --tokens: 128K and 1M
    fixed = facts["fixed_state_bytes"]
    assert fixed >= 34 * 64 * 128 * 128 * 4  # the KDA states, fp32
    kda = 34 * (64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2)  # states, fp32; conv windows of 3 tokens, bf16
    assert fixed == kda + 2 * 11 * 3 * 128 * 4  # and each indexer's unfinished-pool tail (keys, gates), fp32
    for n, row in facts["cache_bytes"].items():
        assert row["total"] == int(n) * (11 * 512 * 2 + 11 * 128 * 2 // 4) + fixed
        assert row["per_token_dsa_total"] == int(n) * (11 * 512 * 2 + 11 * 128 * 2) + kda  # a key per token
        assert row["dense_mla_total"] == int(n) * 11 * 512 * 2 + kda


def test_info_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    line = assert_error(indexpool("info", "--config", str(bad)), 3)
    assert "not a glm5_next config" in line and "model_type" in line
    assert_error(indexpool("info", "--config", str(tmp_path / "missing.json")), 3)
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "its JSON is not an object" in assert_error(indexpool("info", "--config", str(tmp_path / "list.json")), 3)
    os.mkfifo(tmp_path / "fifo.json")  # would block the read, as /dev/zero would never end it
    for special in (tmp_path / "fifo.json", Path("/dev/zero")):
        assert "is not a regular file" in assert_error(indexpool("info", "--config", str(special)), 3)
    for args in (["--model", str(tmp_path)], ["--tokens", "1M,lots"]):
        proc = indexpool("info", "--config", str(bad), *args)
        assert proc.returncode == 2 and b"Traceback" not in proc.stderr and proc.stdout == b""


# ------------------------------------------------------------------------------------------- generation

def test_complete_runs_the_models_own_attention(checkpoint, loaded):
    """--attention auto and dense both run glm5_next's DSA attention: the engine's greedy tokens in-process."""
    outputs = [json.loads(ok(indexpool("complete", "--model", str(checkpoint), *GREEDY, "--json", "-n", "12",
                                       *attention, PROMPT)))
               for attention in ([], ["--attention", "dense"])]
    assert outputs[0]["text"] == outputs[1]["text"]
    ids = loaded.tokenizer.encode(PROMPT)
    text, new_tokens = greedy_text(loaded, ids, 12)
    assert (outputs[0]["text"], outputs[0]["new_tokens"], outputs[0]["prompt_tokens"]) == (text, new_tokens, len(ids))
    assert new_tokens > 0


def test_speculative_complete_gives_the_greedy_text(checkpoint, loaded):
    """--speculative (the MTP layer drafting, the next forward checking) prints the text plain greedy decoding
    prints, and says in --json how many drafts it checked and kept; the stop on end tokens still holds."""
    plain = json.loads(ok(indexpool("complete", "--model", str(checkpoint), *GREEDY, "--json", "-n", "20", PROMPT)))
    drafted = json.loads(ok(indexpool("complete", "--model", str(checkpoint), *GREEDY, "--json", "-n", "20",
                                      "--speculative", PROMPT)))
    assert drafted["text"] == plain["text"] and drafted["new_tokens"] == plain["new_tokens"] > 0
    assert drafted["stop_reason"] == plain["stop_reason"]
    assert 0 <= drafted["drafts"]["kept"] <= drafted["drafts"]["checked"] and drafted["drafts"]["checked"] > 0
    assert "drafts" not in plain


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "0.7"], "--speculative decodes greedily"),  # sampling asked for
    (["--temperature", "0", "--attention", "indexpool"], "IndexPool does not apply"),  # the checks of the model's own sessions still run
])
def test_speculative_complete_usage_errors(checkpoint, extra, message):
    proc = indexpool("complete", "--model", str(checkpoint), "--dtype", "fp32", "--quiet", "--speculative", *extra,
                     PROMPT)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"" and "Traceback" not in stderr and message in stderr


def test_speculative_needs_an_mtp_layer():
    """The default model (llama family) has no MTP layer: a usage error naming the option."""
    proc = indexpool("complete", "--temperature", "0", "--quiet", "--speculative", PROMPT)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"" and "Traceback" not in stderr and "MTP layer" in stderr


def test_indexpool_attention_is_a_usage_error(checkpoint):
    proc = indexpool("complete", "--model", str(checkpoint), *GREEDY, "--attention", "indexpool", PROMPT)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b"" and "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("indexpool: error: ")]  # the one-line form
    assert len(errors) == 1 and "own DSA indexer" in errors[0]


def test_chat_two_turns_in_the_models_template(checkpoint, loaded):
    turns = ["Hello there.", "What do pools hold?"]
    out = ok(indexpool("chat", "--model", str(checkpoint), *GREEDY, "--json", "-n", "10",
                       stdin="".join(t + "\n" for t in turns).encode()))
    replies = [json.loads(line) for line in out.splitlines()]
    assert len(replies) == 2
    tok = loaded.tokenizer
    first = [{"role": "user", "content": turns[0]}]
    second = first + [{"role": "assistant", "content": replies[0]["text"]}, {"role": "user", "content": turns[1]}]
    for reply, messages in zip(replies, (first, second)):
        assert reply["prompt_tokens"] == len(tok.encode_chat(messages))
        assert reply["stop_reason"] in STOP_REASONS and reply["new_tokens"] <= 10
    assert (replies[0]["text"], replies[0]["new_tokens"]) == greedy_text(loaded, tok.encode_chat(first), 10)


# -------------------------------------------------------------------------------------------- documents

def test_ask_reads_the_document_once_and_restores_it_from_the_cache(checkpoint, tmp_path):
    """First run: the document is read and saved. Second run, two questions: the document comes from the cache
    (Glm5NextCache's state round trip) and the first answer is the first run's; the second question, asked after
    the first in the same run, is answered as when asked alone without the cache."""
    document = tmp_path / "notes.txt"
    document.write_text("The pools hold the keys of four tokens each. " * 20)
    questions = ["What do pools hold?", "How many tokens per pool?"]
    run = ["ask", "--model", str(checkpoint), *GREEDY, "--json", "-n", "8", "--cache-dir", str(tmp_path / "cache"),
           str(document)]
    (first,) = [json.loads(line) for line in ok(indexpool(*run, questions[0])).splitlines()]
    both = [json.loads(line) for line in ok(indexpool(*run, questions[0], "-Q", questions[1])).splitlines()]
    (alone,) = [json.loads(line) for line in ok(indexpool(*run, "--no-cache", questions[1])).splitlines()]
    assert not first["cached"] and both[0]["cached"]
    assert both[0]["text"] == first["text"] and both[0]["tokens"] == first["tokens"]
    assert both[1]["text"] == alone["text"] and both[1]["tokens"] == alone["tokens"]
    assert any(result["tokens"]["new"] for result in (first, alone))
    for result in (first, *both, alone):
        assert result["sources"] == [] and result["notes"]  # sources come only from IndexPool's evidence
