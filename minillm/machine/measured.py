"""This machine, measured once, for every chapter that needs its numbers.

Memory bandwidth and matmul rates move by several per cent from one run to the next, more on a
machine shared with other jobs, and by a factor between memory levels (main memory against a
cache that holds the weights). A book that measured them afresh in every chapter would print a
different ridge point in each for the same machine. So chapter 1 measures the machine and
saves what it measured with :func:`save_profile`; a later chapter calls :func:`machine_profile`,
which loads that profile and measures (and saves) only when none of this machine is saved.
``python -m minillm.machine.measured`` measures this machine afresh and saves it, as chapter 1 does.

The file lives in the cache (``.cache/machine/``), one per device, and QUICK runs keep their
own: a profile measured on small buffers must never stand for the real one. A profile measured
on another machine, or with another thread count, is not used.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minillm.machine.hardware import (DTYPES, MAIN_MEMORY_BYTES, MachineProfile, device_from_flag, device_name,
                                      measure_machine, resolve_device, runs_matmul)
from minillm.settings import cache_dir, quick


def profile_path(device: torch.device | str | None = None, small: bool | None = None) -> Path:
    """Where this device's profile is kept: ``.cache/machine/cpu.json``, or ``cpu-quick.json``
    for one measured small (``small``, default: a QUICK run)."""
    device = resolve_device(device)
    small = quick() if small is None else small
    return cache_dir("machine") / f"{device.type}{'-quick' if small else ''}.json"


def save_profile(profile: MachineProfile) -> Path:
    """Write ``profile`` (with the working-set bandwidths measured so far) for later chapters;
    one measured on buffers smaller than main memory's goes to the QUICK file, whoever asks."""
    path = profile_path(profile.device, small=profile.bandwidth_bytes < MAIN_MEMORY_BYTES)
    path.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return path


def load_profile(device: torch.device | str | None = None) -> MachineProfile | None:
    """The saved profile of this device, or None when there is none, it cannot be read, or it
    was measured on another machine or with another thread count (the name says both)."""
    device = resolve_device(device)
    try:
        profile = MachineProfile.from_dict(json.loads(profile_path(device).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return profile if profile.device == str(device) and profile.name == device_name(device) else None


def machine_profile(device: torch.device | str | None = None) -> MachineProfile:
    """Chapter 1's measurement of this machine when it is saved; otherwise measured now (every
    dtype the device runs) and saved, so the chapters after this one read the same numbers."""
    device = resolve_device(device)
    saved = load_profile(device)
    runs = [d for d, dtype in DTYPES.items() if runs_matmul(device, dtype)]
    if saved is not None and all(d in saved.flops for d in runs):
        return saved
    profile = measure_machine(device, runs)
    save_profile(profile)
    return profile


def describe(profile: MachineProfile) -> str:
    """One line saying whose numbers these are, for a chapter to print above its own."""
    rates = ", ".join(f"{d} {v / 1e9:,.0f} GFLOP/s" for d, v in profile.flops.items())
    return (f"{profile.name}, measured {profile.measured_at or 'at an unknown time'}: main memory "
            f"{profile.bandwidth / 1e9:.1f} GB/s; matmul {rates}")


def main(argv: list[str] | None = None) -> int:
    from minillm.cli import ArgumentParser

    parser = ArgumentParser(prog="python -m minillm.machine.measured",
                            description="Measure this machine and save the profile the book's chapters read.")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:1 | mps (default: the best available)")
    parser.add_argument("--quick", action="store_true", help="small sizes, kept apart from the real profile")
    args = parser.parse_args(argv)
    profile = measure_machine(device_from_flag(args.device), small=args.quick or None)
    print(profile.table(), f"\nsaved to {save_profile(profile)}", sep="\n")
    return 0


if __name__ == "__main__":
    from minillm.cli import run

    run(main, prog="python -m minillm.machine.measured")
