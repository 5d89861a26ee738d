"""`indexpool distill`: train a lightning indexer for a model from its own dense attention, offline.

The defaults reproduce the indexer shipped for the default model (see `model/indexer_training.py` for the recipe).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from .console import InputError, err_console
from .options import SEED_MAX

# The shipped indexer's run (DistillConfig has the same defaults; repeated so the CLI starts without torch).
DEFAULT_STEPS, DEFAULT_SEQUENCES, DEFAULT_CONTEXT = 2000, 56, 8192


def distill(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct).", envvar="INDEXPOOL_MODEL")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to write the indexer (default: the shipped location for the default model, else ./<model>.lightning.safetensors).")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps, each on the sampled queries of one captured sequence.")] = DEFAULT_STEPS,
    sequences: Annotated[int, typer.Option("--sequences", min=1, help="Sequences run through the dense model over the whole run.")] = DEFAULT_SEQUENCES,
    context: Annotated[int, typer.Option("--context", help="Tokens per sequence (at most the model's trained context).")] = DEFAULT_CONTEXT,
    kpool: Annotated[int, typer.Option("--kpool", help="Tokens merged into one pooled key.")] = 4,
    storage: Annotated[str, typer.Option("--storage", help="Pooled-key storage simulated in training: bf16 or fp8.")] = "bf16",
    key_dim: Annotated[int, typer.Option("--key-dim", min=1, help="Width of an index key (and of a stored pooled key).")] = 32,
    heads: Annotated[int, typer.Option("--heads", min=1, help="Index heads.")] = 4,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: one per physical core).")] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, max=SEED_MAX, help="Seed for initial weights, query sampling and batch order (0 to 2**64-1).")] = 0,
    text: Annotated[Optional[list[Path]], typer.Option("--text", help="A UTF-8 text file to train on; repeat for more (default: pydoc topics, the common licenses, the standard library's sources). The last file's last --context tokens are the validation text.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr.")] = False,
):
    """Distill a lightning indexer (IndexPool's trained k-pool indexer) from the model's dense attention."""
    from indexpool.model.indexer_training import DistillConfig, SparsePattern, default_training_texts, token_windows, validation_text
    from indexpool.model.indexer_training import distill as run_distillation
    from indexpool.model.lightning_indexer import ModelFingerprint, default_indexer_location
    from indexpool.model.runtime import load_engine, set_threads

    pattern = SparsePattern(kpool=kpool)
    config = DistillConfig(context=context, sequences=sequences, steps=steps, storage=storage, seed=seed, pattern=pattern)
    try:
        if kpool < 1 or pattern.sinks % kpool or pattern.topk % kpool:
            raise ValueError(f"kpool must divide the {pattern.sinks} sinks and topk={pattern.topk}")
        config.validate()
        set_threads(threads)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    texts = [(str(path), _read_text(path)) for path in text] if text else None

    loaded = load_engine(model, dtype="auto", decode_weights="off")
    if context > loaded.config.context_length:
        raise typer.BadParameter(f"--context {context} is beyond the model's trained context of {loaded.config.context_length} tokens")
    tokenizer = loaded.tokenizer
    if texts is None:
        token_lists = [tokenizer.encode(t) for _, t in default_training_texts()]
        validation = tokenizer.encode(validation_text())[:context]
        if len(validation) < context:
            raise InputError(f"the built-in validation text has {len(validation):,} tokens: use --context "
                             f"{len(validation)} or less, or give your own texts with --text")
    else:
        token_lists = [tokenizer.encode(t) for _, t in texts]
        validation, token_lists[-1] = token_lists[-1][-context:], token_lists[-1][:-context]
    windows = token_windows(token_lists, context)
    if len(validation) < context or not windows:
        raise InputError(f"the texts are too short: they need at least {2 * context:,} tokens (one window of "
                         f"--context tokens to train on, and the last file's last {context:,} tokens to validate)")
    out = out or default_indexer_location(loaded.name)
    _check_out(out)

    with _progress(steps, enabled=err_console.is_terminal and not quiet) as on_progress:
        result = run_distillation(loaded.model, ModelFingerprint.of(loaded), windows, validation, config,
                                  key_dim=key_dim, heads=heads, on_progress=on_progress)
    try:
        _write_atomically(result.indexer, out)
    except OSError as e:  # the folder went away or filled up while training ran
        raise InputError(f"cannot write {out}: {e.strerror or e}") from None
    minutes, seconds = divmod(round(result.seconds), 60)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    print(f"validation KL per query and layer: {result.loss_before:.3f} before, {result.loss_after:.3f} after "
          f"(training loss over the last tenth of the steps: {result.train_loss_last:.3f})")
    print(f"{steps} steps, {sequences} sequence(s) of {context} tokens, in {minutes}m{seconds:02d}s "
          f"({result.capture_seconds / 60:.1f} min running the dense model), {_threads()} thread(s)")


def _read_text(path: Path) -> str:
    """A --text file, whole: a regular file of at most the size any one input may be (a pipe or a device would
    block the read or never end it)."""
    from .ingest import IngestOptions, NotRegularFile, OverLimit, read_regular_file, size_text

    limit = IngestOptions.max_input_bytes
    try:
        data = read_regular_file(str(path), limit)
    except FileNotFoundError:
        raise InputError(f"text file not found: {path}") from None
    except NotRegularFile as e:
        raise InputError(f"{path} is not a regular file ({e.args[0]}): give --text a text file") from None
    except OverLimit:
        raise InputError(f"{path} holds over {size_text(limit)}, the most one text may: split it") from None
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not valid UTF-8 (byte {e.start}); convert it first, e.g. with iconv") from None


def _check_out(path: Path) -> None:
    """Refuse an --out the indexer cannot be written to before the training run, not after it: a directory, or a
    folder that cannot be made or written in."""
    if path.is_dir():
        raise InputError(f"--out {path} is a directory: give a file name, e.g. {path / 'indexer.safetensors'}")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # the first folder that exists is where one is made
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"--out {path}: {folder} is not a directory")
    try:  # a file made and removed: permissions, a read-only or pseudo file system (/proc) alike
        fd, probe = tempfile.mkstemp(prefix=".indexpool-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"--out {path}: cannot write in {folder} ({e.strerror or e})") from None


def _write_atomically(indexer, path: Path) -> None:
    """A temporary file in the target directory, then a rename: a reader never sees a half-written indexer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        indexer.save(temporary)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes it private; the result is an ordinary file
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _threads() -> int:
    import torch

    return torch.get_num_threads()


@contextlib.contextmanager
def _progress(total: int, enabled: bool):
    """A bar over training steps with the latest loss, on stderr when it is a terminal; else nothing."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("distilling"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task("distill", total=total, loss="-")
        yield lambda step, _total, loss: progress.update(task, completed=step, loss=f"{loss:.3f}")
