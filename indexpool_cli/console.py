"""Terminal plumbing shared by the commands: stderr console, errors, stdin input, progress."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, NoReturn

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from indexpool.model.errors import InputError  # the user's input cannot be used: exit code 3

err_console = Console(stderr=True, highlight=False)


# One chat message: longer lines are refused (a line without end, such as /dev/zero, would otherwise be read whole).
MAX_MESSAGE_CHARS = 10_000_000


def read_message(stream) -> str:
    """The next line of `stream` ("" at its end); InputError when it runs past MAX_MESSAGE_CHARS."""
    try:
        line = stream.readline(MAX_MESSAGE_CHARS + 1)
    except UnicodeDecodeError:
        raise InputError("the messages on stdin are not valid UTF-8; convert them first, e.g. with iconv") from None
    if len(line) > MAX_MESSAGE_CHARS:
        raise InputError(f"a message is longer than {MAX_MESSAGE_CHARS:,} characters: give one message a line")
    return line


class OutputError(Exception):
    """Standard output refused what was written: a full disk or a device error under `> file`."""


class GuardedStdout:
    """sys.stdout whose write errors say they are standard output's (OutputError); a reader gone away
    (BrokenPipeError) passes unchanged, as it ends a command quietly."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        with self._named_errors():
            return self.stream.write(text)

    def flush(self) -> None:
        with self._named_errors():
            self.stream.flush()

    @staticmethod
    @contextlib.contextmanager
    def _named_errors():
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(f"cannot write to standard output: {e.strerror or e}") from None

    def __getattr__(self, name):
        return getattr(self.stream, name)


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr (none when stderr is closed), then exit with `code`."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            err_console.print(f"indexpool: error: {message}", markup=False, soft_wrap=True)
    sys.exit(code)


def hint_terminal_stdin() -> None:
    """Before stdin is read from a terminal (`ask - "question"` typed as is), say so on stderr, when that is a
    terminal too: the command waits for typed text, which would otherwise look like a hang."""
    if sys.stdin.isatty() and err_console.is_terminal:
        err_console.print("[dim]reading stdin from the terminal: type or paste the text, then Ctrl-D on a line of its "
                          "own[/dim]")


def read_text_input(argument: str | None) -> str:
    """The prompt argument, or stdin when the argument is '-' or absent and stdin is not a terminal."""
    if argument is not None and argument != "-":
        return argument
    if argument is None and sys.stdin.isatty():
        raise InputError("no input: give the text as an argument, or '-' / a pipe to read stdin")
    hint_terminal_stdin()
    from .ingest import IngestOptions, OverLimit, read_at_most, size_text

    limit = IngestOptions.max_input_bytes
    try:
        data = read_at_most(sys.stdin.buffer, limit)
    except OverLimit:
        raise InputError(f"stdin holds over {size_text(limit)}, the most one input may: give a shorter text") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"stdin is not valid UTF-8 (byte {e.start}); convert it first, e.g. with iconv") from None


@contextlib.contextmanager
def prefill_progress(total: int, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar over prompt tokens while the prompt is read; nothing when stderr is not a terminal."""
    if not enabled or total < 2048:
        yield None
        return
    columns = (TextColumn("reading"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
    start = time.perf_counter()
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task("prefill", total=total, rate="")

        def update(done: int, _total: int) -> None:
            progress.update(task, completed=done, rate=f"{done / (time.perf_counter() - start):.0f} tok/s")

        yield update


def show_stats(stats, newline: bool) -> None:
    """A dim line of token counts and speeds on stderr, when it is a terminal."""
    if not err_console.is_terminal:
        return
    if newline:
        sys.stdout.write("\n")
        sys.stdout.flush()
    drafts = f", {stats.accepted}/{stats.drafted} drafts kept" if stats.drafted else ""
    err_console.print(
        f"[dim]{stats.prompt_tokens} prompt tokens at {stats.prefill_tokens_per_second:.0f} tok/s, "
        f"{stats.new_tokens} new at {stats.decode_tokens_per_second:.1f} tok/s ({stats.stop_reason}{drafts})[/dim]"
    )
