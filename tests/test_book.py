"""The book builds offline with warnings as errors, and contains every page of _toc.yml."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def source_of(entry: str) -> Path:
    matches = [ROOT / f"{entry}{ext}" for ext in (".md", ".ipynb") if (ROOT / f"{entry}{ext}").is_file()]
    assert len(matches) == 1, f"_toc.yml entry {entry!r} should be exactly one .md or .ipynb file"
    return matches[0]


def test_every_toc_entry_exists():
    for entry in toc_files():
        source_of(entry)


def test_every_notebook_is_in_the_toc():
    listed = {source_of(e) for e in toc_files()}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert nb in listed, f"{nb.name} is not in _toc.yml"


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_outputs_were_committed_in_order(notebook):
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    assert not [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]


@pytest.fixture(scope="module")
def built_book(tmp_path_factory):
    out = tmp_path_factory.mktemp("book")
    result = subprocess.run(
        [str(Path(sys.executable).parent / "jupyter-book"), "build", "--warningiserror", "--nitpick", "--keep-going",
         "--path-output", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / "_build" / "html"


def test_book_builds_every_page(built_book):
    for entry in toc_files():
        assert (built_book / f"{entry}.html").is_file(), entry
    assert (built_book / "index.html").is_file()


def test_book_serves_its_own_mathjax(built_book):
    assert (built_book / "_static" / "mathjax" / "tex-chtml.js").is_file()
