"""The `indexpool` command (and `python -m indexpool`). The command line's imports take a noticeable moment, so
they happen inside the handler: Ctrl-C at any moment, start-up included, ends with one line and exit code 130, and a
reader that goes away (`| head`) ends it quietly."""

import os
import signal
import sys


def main() -> None:
    try:
        from .app import main as run

        run()
    except KeyboardInterrupt:
        _end("interrupted", 130)
    except BrokenPipeError:
        _end(None, 0)


def _end(message: str | None, code: int) -> None:
    """Exit at once: no further Ctrl-C, no flush of a closed pipe, no wait for worker threads at shutdown (each of
    which could print a traceback of its own)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if message and sys.stderr is not None:
        try:
            sys.stderr.write(f"indexpool: error: {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    if sys.stdout is not None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
