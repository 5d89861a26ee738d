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


def default_map(group) -> dict:
    """Click's default_map (command -> option -> value) from the config file; {} when there is none."""
    path = config_path()
    if not path.is_file():
        if os.environ.get("INDEXPOOL_CONFIG"):  # a file asked for by name that is not there is a mistake
            what = "not a regular file" if path.exists() else "not found"
            raise ConfigError(f"config file {path}: {what} (INDEXPOOL_CONFIG names it; unset it for no config file)")
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
            if unknown := sorted(set(table) - commands[name].keys()):
                raise ConfigError(f"{path}: [{name}] has no option {', '.join(unknown)}")
    for name, params in commands.items():
        values = {params[k]: v for k, v in common.items() if k in params} | \
            {params[k]: v for k, v in data.get(name, {}).items()}
        if values:
            _place(result, name, values)
    return result


def _commands(group, prefix: str = "") -> dict[str, dict[str, str]]:
    """Every command (nested ones as "cache.list") with its options: the names a config file may give each (its
    long option's with underscores, `json` for --json, or its parameter's, `json_out`), to its parameter's name."""
    found = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group
            found.update(_commands(command, f"{prefix}{name}."))
            continue
        names: dict[str, str] = {}
        for param in command.params:
            # param_type_name, not isinstance: typer may bring its own copy of click's classes
            if param.param_type_name == "option":
                names[param.name] = param.name
                for option in param.opts:
                    if option.startswith("--"):
                        names.setdefault(option[2:].replace("-", "_"), param.name)
        found[prefix + name] = names
    return found


def _place(tree: dict, dotted: str, values: dict) -> None:
    *groups, leaf = dotted.split(".")
    for group in groups:
        tree = tree.setdefault(group, {})
    tree[leaf] = values
