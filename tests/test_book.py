"""The book: every page of _toc.yml is built offline with warnings as errors; every chapter has
its committed outputs, produced in order; every chapter opens and closes the same way; no page
needs the network; and the README reaches every chapter in one click."""

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BOOK_URL = "https://minillm.github.io/minillm/"  # GitHub Pages of the repository in _config.yml


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


def markdown_cells(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def test_every_toc_entry_exists():
    for entry in toc_files():
        source_of(entry)


def test_every_notebook_is_in_the_toc_in_file_order():
    listed = [source_of(e) for e in toc_files()]
    in_toc = [path for path in listed if path.suffix == ".ipynb"]
    assert in_toc == NOTEBOOKS, "every notebook must be in _toc.yml, in the order of its number"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_were_committed_in_order(notebook):
    cells = [c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    assert [c["execution_count"] for c in cells] == list(range(1, len(cells) + 1))
    assert not [o for c in cells for o in c["outputs"] if o["output_type"] == "error"]


GLUE_REFERENCE = re.compile(r"\{glue(?::[a-z]+)?\}`([^`]+)`")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_glued_number_the_prose_cites_is_in_the_committed_outputs(notebook):
    """A figure a paragraph quotes through glue must have been recorded by the committed run: a
    name cited but never glued, or glued by code added after the outputs were committed, would
    render as a warning instead of the number."""
    missing = []
    for text in markdown_cells(notebook):
        for m in GLUE_REFERENCE.finditer(text):
            doc, sep, key = m.group(1).rpartition("::")  # "other.ipynb::name" quotes another chapter's run
            source = (notebook.parent / doc).resolve() if sep else notebook
            if not source.is_file() or key.split(":")[0] not in recorded_glue(source):
                missing.append(m.group(1))
    assert missing == [], f"cited in the prose but not in the committed outputs: {sorted(set(missing))}"


def recorded_glue(notebook: Path) -> set[str]:
    """The names a notebook's committed outputs recorded with myst-nb's ``glue``."""
    cells = json.loads(notebook.read_text())["cells"]
    return {o["metadata"]["scrapbook"]["name"] for c in cells if c["cell_type"] == "code"
            for o in c["outputs"] if "scrapbook" in o.get("metadata", {})}


def test_every_figure_a_prose_page_cites_from_a_chapter_was_recorded_there():
    """book/*.md pages quote chapters' figures with cross-document glue (``path.ipynb::name``):
    the chapter's committed run must have recorded each name."""
    missing = []
    for page in sorted((ROOT / "book").glob("*.md")):
        for m in GLUE_REFERENCE.finditer(page.read_text()):
            doc, sep, key = m.group(1).partition("::")
            if not sep:
                missing.append(f"{page.name}: {m.group(1)!r} names no chapter (use path.ipynb::name)")
                continue
            notebook = (page.parent / doc).resolve()
            if not notebook.is_file() or key.split(":")[0] not in recorded_glue(notebook):
                missing.append(f"{page.name}: {m.group(1)}")
    assert missing == []


BANNER_LINE = re.compile(r"^\s*(device|torch|mode): (.*)$", re.MULTILINE)


def banner(notebook: Path) -> dict[str, str]:
    """The machine a chapter's committed run names in its first printed banner: device (less
    its thread count, which a chapter may set), torch version and mode."""
    cells = json.loads(notebook.read_text())["cells"]
    for cell in cells:
        text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
        lines = dict(BANNER_LINE.findall(text))
        if "device" in lines:
            lines["device"] = re.sub(r" \(\d+ threads?\)", "", lines["device"])
            return lines
    return {}


def test_every_chapter_ran_on_one_machine_at_full_size():
    """The book is one measurement: every chapter's committed outputs come from the same machine
    and torch, at full size (never QUICK)."""
    banners = {notebook.name: banner(notebook) for notebook in NOTEBOOKS}
    assert all(b.get("mode") == "full" for b in banners.values()), banners
    machines = {(b.get("device"), b.get("torch")) for b in banners.values()}
    assert len(machines) == 1, banners


def test_the_cpu_benchmarks_the_chapters_read_come_from_the_chapters_machine():
    """Chapters quote the committed CPU benchmarks beside their own outputs, so those must come from
    the same machine: re-running the chapters on another CPU means re-running these too."""
    machines = {banner(notebook).get("device") for notebook in NOTEBOOKS}
    assert len(machines) == 1, machines
    chapters_cpu = re.sub(r"^cpu \((.*)\)$", r"\1", machines.pop())
    results = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    named = {path.name: json.loads(path.read_text()).get("device") for path in results}
    named = {name: device for name, device in named.items() if device}
    assert named, "no committed CPU benchmark names its machine"
    others = {name: device for name, device in named.items()
              if re.sub(r" \(\d+ threads?\)", "", device) != chapters_cpu}
    assert others == {}, f"the chapters ran on {chapters_cpu!r}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_opens_with_its_goal_and_ends_with_summary_and_exercises(notebook):
    cells = markdown_cells(notebook)
    number = int(notebook.name.split("_")[0])
    assert cells[0].startswith(f"# {number}. "), "the first cell is the chapter's title, '# N. ...'"
    assert re.search(r"\byou need\b|\bneeds nothing\b", cells[0], re.IGNORECASE), \
        "the opening says what the chapter needs from earlier ones"
    headings = [line for cell in cells for line in cell.splitlines() if line.startswith("## ")]
    assert headings[-2:] == ["## Summary", "## Exercises"], headings[-3:]
    exercises = cells[-1].split("## Exercises", 1)[-1]
    items = re.findall(r"^\d+\. ", exercises, re.MULTILINE)
    assert len(items) >= 3 and exercises.count("*Hint:*") >= len(items), "3+ exercises, each with a *Hint:*"


def test_book_builds_every_page(built_book):
    for entry in toc_files():
        assert (built_book / f"{entry}.html").is_file(), entry
    assert (built_book / "index.html").is_file()


def test_book_serves_its_own_mathjax(built_book):
    assert (built_book / "_static" / "mathjax" / "tex-chtml.js").is_file()


class ResourceLinks(HTMLParser):
    """The URLs a page *loads* (scripts, stylesheets, images, frames), not the ones it links to."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("script", "img", "iframe", "source") and a.get("src"):
            self.urls.append(a["src"])
        if tag == "link" and a.get("href") and {"stylesheet", "preload", "icon"} & set((a.get("rel") or "").split()):
            self.urls.append(a["href"])


def test_no_page_loads_anything_from_the_network(built_book):
    offenders = {}
    for page in built_book.rglob("*.html"):
        parser = ResourceLinks()
        parser.feed(page.read_text())
        remote = [u for u in parser.urls if re.match(r"(https?:)?//", u)]
        if remote:
            offenders[str(page.relative_to(built_book))] = remote
    assert offenders == {}


def test_the_glossary_defines_the_terms_the_book_relies_on(built_book):
    html = (built_book / "book" / "glossary.html").read_text()
    for term in ("TTFT", "ITL", "TPOT", "Goodput", "Ridge point", "Arithmetic intensity", "KV cache",
                 "Block table", "Preemption", "Prefix caching", "Continuous batching"):
        assert re.search(rf'<dt id="term-{re.escape(term.replace(" ", "-"))}"', html), term


def test_the_readme_links_every_chapter_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)", readme)
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert [t for t in local if not (ROOT / t).exists()] == []
    for notebook in NOTEBOOKS:
        assert f"notebooks/{notebook.name}" in local, f"README does not link {notebook.name}"
        assert f"{BOOK_URL}notebooks/{notebook.stem}.html" in targets, f"README does not link {notebook.stem}'s page"


def test_the_book_url_is_where_the_pages_workflow_publishes():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    owner, name = config["repository"]["url"].removeprefix("https://github.com/").split("/")
    assert BOOK_URL == f"https://{owner}.github.io/{name}/"


def test_the_options_the_api_page_says_do_not_combine_are_refused_naming_both():
    from minillm.cli import UsageError
    from server.config import parse_args

    section = (ROOT / "book" / "api.md").read_text().split("## Options that do not combine")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 10
    for row in rows:
        flags = re.findall(r"`([^`]+)`", row.split("|")[1])
        assert len(flags) == 2, row
        with pytest.raises(UsageError) as refused:
            parse_args([word for flag in flags for word in flag.split()])
        message = str(refused.value)
        for flag in flags:  # each option named, as its flag or as its keyword
            name = flag.split()[0].removeprefix("--").removeprefix("no-")
            assert name in message or name.replace("-", "_") in message, (row, message)
