"""Compiling a C kernel on first use, for this CPU: the machinery the CPU kernels (`cpu_attention`, `cpu_linear`)
share.

`build_native(source, self_test, test_argv)` compiles `source` with the system's C compiler (`$CC`, else `cc`) for
this CPU (`-march=native`) into a scratch folder of the indexpool cache directory (kernels/), runs `self_test` (a
Python script: sys.argv[1] is the built library, then `test_argv`) in a child process, and renames the library into
place (atomic) once it passed. The library's name carries a hash of the source, the compiler and its flags and the
CPU's feature flags: an edit to any of them builds anew. A build that fails (no compiler, an `#error` for missing
instructions, a self-test that fails or faults) leaves a `.failed` marker with its reason where the library would
be, and is not retried for that source, compiler and CPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's feature flags where the OS lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_cache_dir(kind: str) -> Path:
    """Where the engine keeps what it builds or prepares once (compiled kernels, prepared weights, read documents):
    $XDG_CACHE_HOME/indexpool/KIND, else ~/.cache/indexpool/KIND."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "indexpool" / kind


def build_native(source: Path, self_test: str, test_argv: tuple[str, ...] = (),
                 flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL | None, str]:
    """The compiled library of `source` and a line saying where it came from ("C kernel (path)"), or (None, why
    not: a line starting "torch (", the path that runs instead). Callers cache the answer (functools.cache) and
    declare the functions' argument types themselves."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join((compiler, *flags)).encode(),
                                     cpu_identity().encode()]))
    directory = default_cache_dir("kernels")
    path = directory / f"{source.stem}-{key.hexdigest()[:16]}.so"
    failed = path.with_suffix(".failed")
    if not path.exists():
        if failed.exists():
            return None, failed.read_text()
        reason = _build(compiler, flags, source, self_test, test_argv, directory, path)
        if reason is not None:
            try:
                failed.write_text(reason)  # a few bytes: a torn write only costs a retry
            except OSError:
                pass
            return None, reason
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        return None, f"torch (the C kernel did not load: {error})"
    return library, f"C kernel ({path})"


def _build(compiler: str, flags: tuple[str, ...], source: Path, self_test: str, test_argv: tuple[str, ...],
           directory: Path, path: Path) -> str | None:
    """Compiles and self-tests the library aside, then renames it to `path` (atomic); returns why not, or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            built = Path(scratch) / path.name
            compiled = subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], capture_output=True,
                                      timeout=120)
            if compiled.returncode != 0:
                lines = compiled.stderr.decode(errors="replace").strip().splitlines()
                error = next((line for line in lines if "error" in line), lines[-1] if lines else "no output")
                return f"torch (the C kernel did not build: {error.strip()})"
            tested = subprocess.run([sys.executable, "-c", self_test, str(built), *test_argv],
                                    capture_output=True, timeout=60)
            if tested.returncode != 0:
                lines = tested.stderr.decode(errors="replace").strip().splitlines() or [f"exit {tested.returncode}"]
                return f"torch (the C kernel failed its self-test: {lines[-1]})"
            os.replace(built, path)
    except (OSError, subprocess.SubprocessError) as error:
        return f"torch (the C kernel did not build: {error})"
    return None
