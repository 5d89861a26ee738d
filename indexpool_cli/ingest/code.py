"""Codebases: a folder walked in sorted order, each readable file framed as `=== src/app.py ===` and numbered lines.

Lines are numbered `120| code` so that the model can cite them; cite "src/app.py:120-158". What the walk leaves
out (ignored, hidden, vendored, binary, too big...) is reported in `skipped` with the reason.
"""

from __future__ import annotations

import os
import re

import pathspec

from . import IngestError, IngestOptions, NotRegularFile, OverLimit, Part, printable, read_regular_file, size_text
from .text import decode_text, line_chunks, line_span, looks_binary, split_lines

SOURCE_EXTENSIONS = frozenset(
    ".py .pyi .pyx .js .mjs .cjs .jsx .ts .tsx .vue .svelte .java .kt .kts .scala .groovy .go .rs .c .h .cc "
    ".cpp .cxx .hpp .hh .hxx .cu .cuh .m .mm .cs .fs .swift .rb .php .pl .pm .lua .r .jl .sh .bash .zsh .fish .ps1 "
    ".bat .sql .hs .ml .mli .ex .exs .erl .clj .cljs .dart .zig .nim .f90 .proto .graphql .css .scss .less .toml "
    ".yaml .yml .ini .cfg .cmake .gradle .tf".split()
)
SOURCE_FILE_NAMES = frozenset({"Makefile", "makefile", "GNUmakefile", "Dockerfile", "CMakeLists.txt", "Rakefile",
                               "Gemfile", "Justfile", "BUILD", "WORKSPACE"})
LOCK_FILES = frozenset({"package-lock.json", "npm-shrinkwrap.json", "yarn.lock", "pnpm-lock.yaml", "poetry.lock",
                        "Pipfile.lock", "uv.lock", "pdm.lock", "Cargo.lock", "Gemfile.lock", "composer.lock",
                        "go.sum", "flake.lock", "bun.lockb", "mix.lock", "Podfile.lock", "packages.lock.json"})
VENDORED_DIRS = frozenset({"node_modules", "bower_components", "vendor", "third_party", "dist", "build",
                           "__pycache__", ".venv", "venv", ".tox", ".nox", "target", ".mypy_cache", ".pytest_cache",
                           ".ruff_cache", ".gradle", ".next", ".nuxt", "site-packages"})
GENERATED_SUFFIXES = (".min.js", ".min.css", ".map", ".pyc", ".pyo")
# Known binary formats, skipped without reading them (model weights can be gigabytes); anything else binary is caught
# by its content.
BINARY_EXTENSIONS = frozenset(
    ".pdf .epub .doc .docx .odt .xls .xlsx .ppt .pptx .png .jpg .jpeg .gif .bmp .tif .tiff .webp .ico .heic .mp3 "
    ".wav .flac .ogg .mp4 .mkv .mov .avi .webm .zip .tar .gz .tgz .bz2 .xz .7z .rar .zst .jar .whl .egg .so .dylib "
    ".dll .exe .o .a .lib .class .bin .dat .npy .npz .pt .pth .ckpt .safetensors .gguf .onnx .pkl .db .sqlite .woff "
    ".woff2 .ttf .otf .eot".split()
)
# Folders deeper than this are skipped: no source tree goes near it, and the walk recurses once per level.
MAX_FOLDER_DEPTH = 64
# Bounds on the ignore rules, so that hostile .gitignore files cannot stall the walk. pathspec compiles each rule
# (about 0.25 ms) and checks each path against every rule above it; a rule's wildcards backtrack: "*a*b*c*d" against
# a long name takes a time that grows as the name's length to the power of the wildcards in one path segment
# (seconds with four, minutes with five).
MAX_IGNORE_RULES = 10_000  # in all the walk's .gitignore files
MAX_WILDCARDS_PER_SEGMENT = 2


def is_code_file(path: str) -> bool:
    """A source file by name or extension: given on its own, it is framed with numbered lines like a folder's."""
    name = os.path.basename(path)
    return name in SOURCE_FILE_NAMES or os.path.splitext(name)[1].lower() in SOURCE_EXTENSIONS


def code_parts(text: str, name: str, source: str) -> list[Part]:
    """Parts of up to ~60 numbered lines (cut at a blank line where one is near); the first names the file."""
    lines = split_lines(text)
    parts = []
    for start, end in line_chunks(lines, target=60, shortest=30, longest=60):
        header = "" if parts else f"=== {name} ===\n"
        body = "".join(f"{number}| {line}\n" if line else f"{number}|\n"
                       for number, line in enumerate(lines[start:end], start=start + 1))
        parts.append(Part(header + body, source, f"{name}:{line_span(start + 1, end)}", lines=(start + 1, end)))
    return parts


def read_folder(root: str, prefix: str, options: IngestOptions, skipped: list[tuple[str, str]],
                notes: list[str]) -> list[Part]:
    """The parts of every readable file under `root`; paths shown relative to it, after `prefix`."""
    walk = _FolderWalk(root, prefix, options, skipped, notes)
    try:
        walk.visit(root, "", [], 0)
    except _TotalLimitReached:
        pass
    if not walk.parts:
        reasons: dict[str, int] = {}
        for _path, reason in skipped[walk.first_skipped:]:
            kind = reason.split(" (")[0]
            reasons[kind] = reasons.get(kind, 0) + 1
        summary = ", ".join(f"{count} {reason}" for reason, count in reasons.items()) or "it is empty"
        raise IngestError(f"{os.path.normpath(root)} has no readable text files ({summary})")
    return walk.parts


class _TotalLimitReached(Exception):
    pass


class _FolderWalk:
    def __init__(self, root: str, prefix: str, options: IngestOptions, skipped: list[tuple[str, str]],
                 notes: list[str]) -> None:
        self.root_real = os.path.realpath(root)
        self.root_name = printable(os.path.normpath(root))
        self.prefix = prefix
        self.options = options
        self.skipped = skipped
        self.first_skipped = len(skipped)
        self.notes = notes
        self.parts: list[Part] = []
        self.total_bytes = 0
        self.ignore_rules = 0

    def skip(self, rel: str, reason: str) -> None:
        self.skipped.append((printable(self.prefix + rel), reason))

    def visit(self, folder: str, folder_rel: str, ignore_specs: list[tuple[str, pathspec.PathSpec]],
              depth: int) -> None:
        """Read the files of `folder` (its path relative to the root: `folder_rel`, "" or ending in "/"; `depth`
        folders below the root)."""
        spec = self._read_gitignore(folder, folder_rel)
        if spec is not None:
            ignore_specs = ignore_specs + [(folder_rel, spec)]
        try:
            with os.scandir(folder) as scan:
                entries = sorted(scan, key=lambda entry: entry.name)
        except OSError as e:
            self.skip(folder_rel or "./", f"unreadable ({e.strerror or e})")
            return
        for entry in entries:
            is_folder = entry.is_dir(follow_symlinks=False)
            rel = folder_rel + entry.name + ("/" if is_folder else "")
            reason = self._skip_reason(entry, rel, is_folder, ignore_specs)
            if not reason and is_folder and depth >= MAX_FOLDER_DEPTH:
                reason = f"too deep (over {MAX_FOLDER_DEPTH} folders down)"
            if reason:
                self.skip(rel, reason)
            elif is_folder:
                self.visit(entry.path, rel, ignore_specs, depth + 1)
            else:
                self._read_file(entry, rel)

    def _skip_reason(self, entry: os.DirEntry, rel: str, is_folder: bool,
                     ignore_specs: list[tuple[str, pathspec.PathSpec]]) -> str | None:
        name = entry.name
        if name == ".git":
            return "git metadata"
        ignored_by = _ignored_by(rel, ignore_specs)
        if ignored_by is not None:
            return f"ignored by {ignored_by}.gitignore"
        if name.startswith(".") and not self.options.include_hidden:
            return "hidden"
        if entry.is_symlink():
            return self._symlink_reason(entry)
        if is_folder:
            return "vendored or generated" if name in VENDORED_DIRS or name.endswith(".egg-info") else None
        lower = name.lower()
        if name in LOCK_FILES or lower.endswith(".lock"):
            return "lock file"
        if lower.endswith(GENERATED_SUFFIXES):
            return "generated (minified, source map or bytecode)"
        if os.path.splitext(lower)[1] in BINARY_EXTENSIONS:
            return "binary"
        return None

    def _symlink_reason(self, entry: os.DirEntry) -> str:
        """Symlinks are never followed: no cycle, nothing outside the folder, and no way around the ignore rules; a
        target inside the folder is met at its own path."""
        target = os.path.realpath(entry.path)
        if not os.path.exists(target):
            return "broken symlink"
        if os.path.commonpath([self.root_real, target]) != self.root_real:
            return "symlink to outside the folder"
        return f"symlink to {os.path.relpath(target, self.root_real).replace(os.sep, '/')} (not followed)"

    def _read_gitignore(self, folder: str, folder_rel: str) -> pathspec.PathSpec | None:
        """The rules of the folder's .gitignore: only a regular file, as git reads it (not through a symlink), up
        to the per-file limit, while the walk's rules stay within MAX_IGNORE_RULES. One that is there but not
        applied, or rules left out of it, are noted, since what they would leave out is read."""
        shown = f"{self.root_name}: {printable(self.prefix + folder_rel)}.gitignore"
        try:
            data = read_regular_file(os.path.join(folder, ".gitignore"), self.options.max_file_bytes,
                                     follow_symlinks=False)
        except FileNotFoundError:
            return None
        except NotRegularFile as e:
            self.notes.append(f"{shown} is {e.args[0]}, not a regular file: its rules are not applied")
            return None
        except OverLimit:
            self.notes.append(f"{shown} is over {size_text(self.options.max_file_bytes)}: its rules are not applied")
            return None
        except OSError as e:
            self.notes.append(f"{shown} cannot be read ({e.strerror or e}): its rules are not applied")
            return None
        lines = [line for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
        if self.ignore_rules + len(lines) > MAX_IGNORE_RULES:
            self.notes.append(f"{shown} would take the folder's ignore rules over {MAX_IGNORE_RULES:,}: its rules "
                              f"are not applied")
            return None
        self.ignore_rules += len(lines)
        spec, left_out = _ignore_spec(lines)
        if left_out:
            self.notes.append(f"{shown}: {left_out} rule(s) left out (not valid, or over {MAX_WILDCARDS_PER_SEGMENT} "
                              f"wildcards in one path segment)")
        return spec

    def _read_file(self, entry: os.DirEntry, rel: str) -> None:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError as e:
            self.skip(rel, f"unreadable ({e.strerror or e})")
            return
        if info.st_size > self.options.max_file_bytes:
            self.skip(rel, f"too big ({size_text(info.st_size)} > {size_text(self.options.max_file_bytes)} per file)")
            return
        if self.total_bytes + info.st_size > self.options.max_total_bytes:
            limit = size_text(self.options.max_total_bytes)
            self.skip(rel, f"total limit reached ({limit}): this and later files not read")
            self.notes.append(f"{self.root_name}: stopped at {printable(self.prefix + rel)}: the folder is over {limit} "
                              f"(max_total_bytes)")
            raise _TotalLimitReached
        try:
            data = read_regular_file(entry.path, self.options.max_file_bytes, follow_symlinks=False)
        except NotRegularFile as e:  # a device or a named pipe would never end, or block
            self.skip(rel, f"not a regular file ({e.args[0]})")
            return
        except OverLimit as e:  # grown since it was listed
            self.skip(rel, f"too big ({size_text(e.args[0])} > {size_text(self.options.max_file_bytes)} per file)")
            return
        except OSError as e:
            self.skip(rel, f"unreadable ({e.strerror or e})")
            return
        if not data.strip():
            self.skip(rel, "empty")
            return
        if looks_binary(data):
            self.skip(rel, "binary")
            return
        text = decode_text(data)
        if text is None:
            self.skip(rel, "undecodable")
            return
        self.total_bytes += len(data)
        self.parts += code_parts(text, printable(self.prefix + rel), self.prefix + rel)  # named as shown, kept as is


def _ignore_spec(lines: list[str]) -> tuple[pathspec.PathSpec, int]:
    """The rules of a .gitignore's lines, and how many lines were left out: those with over
    MAX_WILDCARDS_PER_SEGMENT wildcards in a path segment, and those that are not valid patterns (a lone "!")."""
    tamed = [rule for rule in map(_tamed, lines) if rule is not None]
    try:
        spec = pathspec.GitIgnoreSpec.from_lines(tamed)
    except (ValueError, re.error):  # pathspec's GitIgnorePatternError, or a bracket it compiles to a bad regex
        # ("[a-[]"): the bad lines found one by one, and left out
        tamed = [rule for rule in tamed if _valid(rule)]
        spec = pathspec.GitIgnoreSpec.from_lines(tamed)
    return spec, len(lines) - len(tamed)


def _tamed(line: str) -> str | None:
    """The line with each run of stars made one wildcard, as git reads it (a segment of stars alone is "**", any
    other run "*"); None when a path segment still has over MAX_WILDCARDS_PER_SEGMENT wildcards."""
    segments = []
    for segment in line.split("/"):
        if len(segment) > 1 and not segment.strip("*"):
            segment = "**"
        else:
            segment = re.sub(r"(\\.)|\*+", lambda match: match[1] or "*", segment)  # escaped characters kept
            if sum(match[0] == "*" for match in re.finditer(r"\\.|\*", segment)) > MAX_WILDCARDS_PER_SEGMENT:
                return None
        segments.append(segment)
    return "/".join(segments)


def _valid(rule: str) -> bool:
    try:
        pathspec.GitIgnoreSpec.from_lines([rule])
    except (ValueError, re.error):
        return False
    return True


def _ignored_by(rel: str, ignore_specs: list[tuple[str, pathspec.PathSpec]]) -> str | None:
    """The folder (relative, "" for the root) whose .gitignore ignores `rel`, or None.

    As in git, a deeper .gitignore overrides a shallower one: the last that has a matching rule decides, and a
    `!negation` there re-includes the path.
    """
    decision: tuple[bool, str] | None = None
    for base, spec in ignore_specs:
        result = spec.check_file(rel[len(base):])
        if result.include is not None:
            decision = (result.include, base)
    return decision[1] if decision and decision[0] else None
