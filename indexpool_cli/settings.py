"""User defaults: `~/.config/indexpool/config.toml` (or $INDEXPOOL_CONFIG), and INDEXPOOL_* environment variables.

The file sets option defaults by their long name with underscores, for every command at the top level or for one
command in its own table; options given on the command line win, then environment variables, then the file:

    threads = 2
    kv_storage = "int8"

    [ask]
    max_new_tokens = 300

    [summarize]
    length = "short"

Every option also reads INDEXPOOL_<COMMAND>_<OPTION> (e.g. INDEXPOOL_ASK_MAX_NEW_TOKENS=300), and the common ones
have short forms (INDEXPOOL_MODEL, INDEXPOOL_THREADS, INDEXPOOL_CACHE_DIR, ...: see `--help`).
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigError(Exception):
    """The config file is unreadable or names an option no command has: exit code 2."""


def config_path() -> Path:
    if explicit := os.environ.get("INDEXPOOL_CONFIG"):
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "indexpool" / "config.toml"


def default_map(group, path: Path | None = None) -> dict:
    """Click's default_map (command -> option -> value) from the config file; {} when there is none."""
    path = path or config_path()
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    commands = _commands(group)
    common = {k: v for k, v in data.items() if not isinstance(v, dict)}
    known = {name for params in commands.values() for name in params}
    if unknown := sorted(set(common) - known):
        raise ConfigError(f"{path}: no command has an option {', '.join(unknown)}")
    result: dict = {}
    for name, table in data.items():
        if isinstance(table, dict):
            if name not in commands:
                raise ConfigError(f"{path}: [{name}] is not a command ({', '.join(sorted(commands))})")
            if unknown := sorted(set(table) - commands[name]):
                raise ConfigError(f"{path}: [{name}] has no option {', '.join(unknown)}")
    for name, params in commands.items():
        values = {k: v for k, v in common.items() if k in params} | data.get(name, {})
        if values:
            _place(result, name, values)
    return result


def _commands(group, prefix: str = "") -> dict[str, set[str]]:
    """Every command (nested ones as "cache.list") with the names of its options."""
    found = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group
            found.update(_commands(command, f"{prefix}{name}."))
        else:
            # param_type_name, not isinstance: typer may bring its own copy of click's classes
            found[prefix + name] = {p.name for p in command.params if p.param_type_name == "option"}
    return found


def _place(tree: dict, dotted: str, values: dict) -> None:
    *groups, leaf = dotted.split(".")
    for group in groups:
        tree = tree.setdefault(group, {})
    tree[leaf] = values
