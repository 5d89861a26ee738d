"""Option groups shared by commands: a dataclass whose fields are Typer options, added to a command's signature
and handed to it as one argument, so each group is declared once."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing

import typer

SEED_MAX = 2**64 - 1  # a seed is a 64-bit unsigned integer (torch.Generator.manual_seed)


def finite(value: float | None) -> float | None:
    """Callback of a float option without a maximum: inf passes its range check, and is refused here."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def option_group(group: type, argument: str, **defaults):
    """Decorator: add the dataclass `group`'s fields as options of the command, collected into `argument`.
    `defaults` overrides field defaults for this command (e.g. greedy decoding for `ask`)."""
    hints = typing.get_type_hints(group, include_extras=True)
    group_fields = dataclasses.fields(group)
    unknown = set(defaults) - {f.name for f in group_fields}
    if unknown:
        raise TypeError(f"{group.__name__} has no field(s) {', '.join(sorted(unknown))}")

    def decorate(fn):
        signature = inspect.signature(fn, eval_str=True)
        added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(f.name, f.default),
                                   annotation=hints[f.name]) for f in group_fields]
        kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()
                if p.name != argument]

        @functools.wraps(fn)
        def run(**kwargs):
            chosen = group(**{f.name: kwargs.pop(f.name) for f in group_fields})
            return fn(**{argument: chosen}, **kwargs)

        run.__signature__ = signature.replace(parameters=kept + added)
        return run

    return decorate
