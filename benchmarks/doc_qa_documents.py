"""The real documents of the document-QA benchmark (benchmarks/doc_qa.py): where each comes from on the system, and
how it is laid out for `indexpool` to read. Nothing is shipped in the repository: the PDFs come from Debian
documentation packages (installed on request), the rest from files every machine of this project has (Python's own
standard library and documentation, Debian's changelogs and Node.js's API pages).

Each benchmarks/data/doc_qa_*.json names its document with one of these recipes:
    {"path": FILE, "apt": PACKAGE}                a file as it is (installed with apt-get when --install is given)
    {"gunzip": FILE.gz, "as": NAME}               a compressed text file, unpacked as NAME
    {"pydoc_topics": [TOPIC, ...], "as": NAME}    sections of pydoc_data.topics, each under "=== TOPIC ===", as NAME
    {"stdlib": PACKAGE}                           a package folder of the running Python's standard library

    .venv/bin/python -m benchmarks.doc_qa_documents NAME     # the document's parts as `ask` reads them
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DATA = Path(__file__).resolve().parent / "data"
FOLDER = Path(tempfile.gettempdir()) / "indexpool-doc-qa"


@contextmanager
def documents_folder() -> Iterator[Path]:
    """An empty folder at a fixed path to lay documents out in, removed afterwards (one run at a time). A document's
    text as `ask` reads it names its path: in a new random folder each run, a few tokens of the document changed
    from run to run, and with them an answer where two passages nearly tie."""
    shutil.rmtree(FOLDER, ignore_errors=True)
    FOLDER.mkdir(parents=True)
    try:
        yield FOLDER
    finally:
        shutil.rmtree(FOLDER, ignore_errors=True)


class DocumentMissing(Exception):
    """The system lacks what a document is made from (the message says what to install)."""


def data_files() -> list[Path]:
    return sorted(DATA.glob("doc_qa_*.json"))


def load_set(name_or_path: str) -> dict:
    path = Path(name_or_path)
    if not path.exists():
        path = DATA / f"doc_qa_{name_or_path}.json"
    return json.loads(path.read_text())


def materialize(recipe: dict, workdir: Path, install: bool = False) -> Path:
    """The path `indexpool` reads for `recipe` (made under `workdir` where the recipe lays a file out)."""
    if "path" in recipe:
        path = Path(recipe["path"])
        if not path.exists() and install and recipe.get("apt"):
            subprocess.run(["apt-get", "install", "-y", "-qq", recipe["apt"]], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not path.exists():
            hint = f" (apt-get install {recipe['apt']}, or run with --install)" if recipe.get("apt") else ""
            raise DocumentMissing(f"{path} is not on this system{hint}")
        return path
    if "gunzip" in recipe:
        source = Path(recipe["gunzip"])
        if not source.exists():
            raise DocumentMissing(f"{source} is not on this system")
        out = workdir / recipe["as"]
        out.write_bytes(gzip.decompress(source.read_bytes()))
        return out
    if "pydoc_topics" in recipe:
        from pydoc_data.topics import topics

        missing = [t for t in recipe["pydoc_topics"] if t not in topics]
        if missing:
            raise DocumentMissing(f"pydoc_data.topics of Python {sys.version.split()[0]} lacks {missing}")
        text = "".join(f"=== {t} ===\n\n{topics[t].strip()}\n\n" for t in recipe["pydoc_topics"])
        out = workdir / recipe["as"]
        out.write_text(text)
        return out
    if "stdlib" in recipe:
        source = Path(sysconfig.get_paths()["stdlib"]) / recipe["stdlib"]
        if not source.is_dir():
            raise DocumentMissing(f"{source} is not on this system")
        out = workdir / recipe["stdlib"]
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return out
    raise ValueError(f"unknown document recipe {recipe}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="a document: NAME of benchmarks/data/doc_qa_NAME.json, or such a file")
    parser.add_argument("--install", action="store_true", help="apt-get install the document's Debian package")
    args = parser.parse_args()

    from indexpool.ingest import load_document

    doc_set = load_set(args.name)
    with documents_folder() as folder:
        path = materialize(doc_set["document"], folder, install=args.install)
        document = load_document([str(path)])
        for part in document.parts:
            print(f"----- part cite={part.cite!r}")
            print(part.text, end="")


if __name__ == "__main__":
    main()
