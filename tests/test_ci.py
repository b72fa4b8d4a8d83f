"""The GitHub workflows run what developers run: .ci/run (make test) on every push, and
make book into GitHub Pages from main. A workflow cannot run here; these checks catch the
edits that would quietly break them."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"


def workflow(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as a boolean
    return data


def commands(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_the_test_workflow_runs_the_ci_entry_point_on_pushes_and_pull_requests():
    flow = workflow("test.yml")
    assert {"push", "pull_request"} <= set(flow["on"])
    job = flow["jobs"]["test"]
    assert ".ci/run" in commands(job)
    assert "chromium" in commands(job), "the browser tests need Debian's chromium"
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_book_workflow_builds_with_make_book_and_publishes_its_html():
    flow = workflow("book.yml")
    assert flow["on"]["push"]["branches"] == ["main"]
    assert {"pages": "write", "id-token": "write"}.items() <= flow["permissions"].items()
    build = flow["jobs"]["build"]
    assert "make book" in commands(build)
    upload = [s for s in build["steps"] if str(s.get("uses", "")).startswith("actions/upload-pages-artifact")]
    assert upload and upload[0]["with"]["path"] == "_build/html"
    deploy = flow["jobs"]["deploy"]
    assert deploy["needs"] == "build"
    assert any(str(s.get("uses", "")).startswith("actions/deploy-pages") for s in deploy["steps"])


def test_make_book_is_the_strict_build_the_tests_check():
    recipe = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "jupyter-book build" in line)
    assert "--warningiserror" in recipe and "--nitpick" in recipe


def test_both_workflows_install_the_cpu_torch_wheel():
    for name in ("test.yml", "book.yml"):
        flow = workflow(name)
        job = next(iter(flow["jobs"].values()))
        assert job["env"]["PIP_EXTRA_INDEX_URL"].endswith("/whl/cpu"), name


def test_make_test_requires_triton_so_its_kernel_tests_cannot_silently_skip():
    recipe = (ROOT / "Makefile").read_text().split("test-unit:", 1)[1].splitlines()[1]
    assert "MINILLM_REQUIRE_TRITON=1" in recipe and "pytest tests/" in recipe
    assert "triton" in (ROOT / "Makefile").read_text().split("$(DEV):", 1)[1].splitlines()[1]
