"""One error path: every failure a user can cause ends as exactly one line `indexpool: error: ...` on stderr with the
documented exit code (usage 2, bad input 3, runtime 1, interrupted 130): Click's own usage errors, closed standard
streams, out-of-range thread counts and token counts, and Ctrl-C at any moment after start-up."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from test_cli import INDEXPOOL, TIMEOUT, assert_error, cli_env, indexpool


@pytest.mark.parametrize("args, says", [
    (["ask", "--bogus", "x", "q"], "No such option: --bogus (see 'indexpool ask --help')"),
    (["nosuch"], "No such command 'nosuch'"),
    (["ask"], "Missing argument"),
    (["complete", "-n", "0", "hi"], "'--max-new-tokens' / '-n'"),
    (["complete", "-n", "many", "hi"], "'--max-new-tokens' / '-n'"),
    (["summarize", "x", "--length", "huge"], "--length must be one of"),
    (["cache", "list", "extra"], "unexpected extra argument"),
    (["complete", "--threads", "100", "hi"], "--threads 100 is out of range: give 1 to 64"),
    (["complete", "--threads", "0", "hi"], "--threads 0 is out of range"),
    (["complete", "--seed", str(2**64), "hi"], "'--seed': Input should be less than or equal to 18446744073709551615"),
    (["ask", "x.txt", "q", "--seed", "-1"], "'--seed': Input should be greater than or equal to 0"),
])
def test_usage_errors_are_one_line(args, says):
    assert says.lower() in assert_error(indexpool(*args), 2).lower()


def test_a_bare_group_shows_its_help():
    proc = indexpool("cache")
    assert proc.returncode == 2 and proc.stdout == b"" and b"Usage: indexpool cache" in proc.stderr


def test_more_new_tokens_than_any_context_is_refused_before_anything_runs():
    for command in (["complete"], ["ask", "x.txt"], ["summarize", "x.txt"]):
        line = assert_error(indexpool(*command, "-n", str(10**12), "hi"), 2)
        assert "'--max-new-tokens' / '-n'" in line and "1048576" in line


def test_closed_standard_streams():
    closed_stdout = subprocess.run([str(INDEXPOOL), "complete", "-n", "2", "hi"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=cli_env(), timeout=TIMEOUT,
                                   preexec_fn=lambda: __import__("os").close(1))
    assert closed_stdout.returncode == 2
    assert closed_stdout.stderr.decode().splitlines() == [
        "indexpool: error: standard output is closed (`>&-`); send it to a file or to /dev/null"]
    closed_stdin = subprocess.run([str(INDEXPOOL), "complete", "-"], capture_output=True, env=cli_env(),
                                  timeout=TIMEOUT, preexec_fn=lambda: __import__("os").close(0))
    assert_error(closed_stdin, 3)


def test_ctrl_c_at_any_moment_is_one_line_and_exit_130():
    """Interrupted while importing, loading the model and generating: the same line, never a traceback."""
    for delay in (0.2, 1.0, 4.0):
        # greedy (-t 0): it loops on its story until the interrupt; a sampled completion could stop on its own in
        # about 4 s, and the interrupt then land while Python shuts down (exit -2, no line)
        proc = subprocess.Popen([str(INDEXPOOL), "complete", "-t", "0", "-n", "5000", "--attention", "dense",
                                 "Once upon"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 130, (delay, err.decode())
        assert err.decode().splitlines()[-1:] == ["indexpool: error: interrupted"], (delay, err.decode())
        assert b"Traceback" not in err


def test_a_reader_that_goes_away_ends_it_quietly():
    proc = subprocess.run(f"set -o pipefail; '{INDEXPOOL}' complete -n 300 --attention dense 'Once upon a time' | head -c 1",
                          shell=True, executable="/bin/bash", capture_output=True, env=cli_env(), timeout=TIMEOUT)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()


def test_endless_stdin_is_refused_at_its_cap(monkeypatch):
    """`complete - < /dev/zero` and `chat < /dev/zero`: read up to a cap, then one error, not all memory."""
    import io

    from indexpool_cli import console
    from indexpool_cli.ingest import IngestOptions

    monkeypatch.setattr(IngestOptions, "max_input_bytes", 1000)
    with open("/dev/zero", "rb") as zeros:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(zeros))
        with pytest.raises(console.InputError, match="stdin holds over 1 KB"):
            console.read_text_input("-")
    monkeypatch.setattr(console, "MAX_MESSAGE_CHARS", 1000)
    with open("/dev/zero", "rb") as zeros, pytest.raises(console.InputError, match="longer than 1,000 characters"):
        console.read_message(io.TextIOWrapper(zeros, encoding="utf-8"))
    lines = io.TextIOWrapper(io.BytesIO(b"first\n" + b"x" * 999 + b"\n"), encoding="utf-8")
    assert console.read_message(lines) == "first\n" and console.read_message(lines) == "x" * 999 + "\n"
    assert console.read_message(lines) == ""
    with pytest.raises(console.InputError, match="not valid UTF-8"):
        console.read_message(io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8"))


def test_cache_commands_end_quietly_when_the_reader_is_gone(tmp_path):
    """`indexpool cache list | true`: its output meets a pipe already closed, and it exits 0 with nothing on stderr,
    as the other commands do (click's own handler would exit 1)."""
    import os

    import torch

    from indexpool.model.tensor_cache import TensorCache

    TensorCache(tmp_path).save("0" * 32, [1, 2, 3], {"x": torch.zeros(4)}, "a document")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([str(INDEXPOOL), "cache", "list", "--cache-dir", str(tmp_path)], stdin=subprocess.DEVNULL,
                              stdout=write_end, stderr=subprocess.PIPE, env=cli_env(), timeout=TIMEOUT)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, b"")
