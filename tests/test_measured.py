"""Chapter 1 measures the machine once; later chapters read the same numbers back."""

import json

import pytest

from minillm.machine import measured
from minillm.machine.hardware import MachineProfile, device_name
from minillm.machine.roofline import decode_roof
from minillm.model.config import ModelConfig

TINY = ModelConfig(vocab_size=96, context_length=32, d_model=32, n_layers=2, n_heads=2)


def a_profile(name: str | None = None, buffer_bytes: int = 2**30) -> MachineProfile:
    return MachineProfile("cpu", name or device_name("cpu"), {"copy": 10e9, "reduce": 20e9},
                          {"fp32": 100e9, "bf16": 800e9, "fp16": 90e9}, buffer_bytes, (1024, 2048), 5,
                          "2026-01-01 00:00 UTC")


def test_a_saved_profile_comes_back_whole_with_its_working_sets(home, monkeypatch):
    monkeypatch.delenv("MINILLM_QUICK", raising=False)
    profile = a_profile()
    profile.resident[123_456] = 55e9
    path = measured.save_profile(profile)
    assert path.parent == home / ".cache" / "machine"
    back = measured.load_profile("cpu")
    assert back == profile and back.resident == {123_456: 55e9} and back.matmul_sizes == (1024, 2048)
    assert measured.machine_profile("cpu") == profile  # read, not measured again


def test_quick_runs_keep_their_own_profile(home, monkeypatch):
    monkeypatch.setenv("MINILLM_QUICK", "0")
    measured.save_profile(a_profile())
    monkeypatch.setenv("MINILLM_QUICK", "1")
    assert measured.profile_path("cpu").name == "cpu-quick.json"
    assert measured.load_profile("cpu") is None


@pytest.mark.parametrize("spoil", ["another machine", "garbage", "a dtype missing"])
def test_a_profile_that_is_not_this_machines_is_measured_again(home, monkeypatch, spoil):
    monkeypatch.setenv("MINILLM_QUICK", "1")
    profile = a_profile("some other CPU (64 threads)" if spoil == "another machine" else None, buffer_bytes=2**26)
    if spoil == "a dtype missing":
        profile = MachineProfile(**{**profile.__dict__, "flops": {"fp32": 100e9}})
    assert measured.save_profile(profile) == measured.profile_path("cpu")  # the QUICK file, which a QUICK run reads
    if spoil == "garbage":
        measured.profile_path("cpu").write_text("{not json")
    fresh = measured.machine_profile("cpu")
    assert fresh.flops["fp32"] != 100e9 and fresh.name == device_name("cpu")
    assert json.loads(measured.profile_path("cpu").read_text())["flops"] == fresh.flops  # saved for the next chapter


def test_the_roof_of_a_saved_working_set_is_read_not_measured(home, monkeypatch):
    monkeypatch.delenv("MINILLM_QUICK", raising=False)
    profile = a_profile()
    decode_roof(profile, TINY, "fp32")  # measures the weights' working set once, into the profile
    (nbytes, _), = profile.resident.items()
    profile.resident[nbytes] = 1e15  # a rate no measurement gives: a later roof must read it back
    measured.save_profile(profile)
    assert decode_roof(measured.load_profile("cpu"), TINY, "fp32").bandwidth == 1e15


def test_the_command_line_measures_and_saves(home, monkeypatch, capsys):
    monkeypatch.setenv("MINILLM_QUICK", "1")
    assert measured.main(["--device", "cpu", "--quick"]) == 0
    printed = capsys.readouterr().out
    saved = measured.load_profile("cpu")
    assert f"saved to {measured.profile_path('cpu')}" in printed
    assert saved is not None and saved.table() in printed  # what it printed is what it saved


def test_the_command_line_names_a_device_this_machine_lacks():
    from minillm.cli import UsageError

    with pytest.raises(UsageError, match="^--device nosuch"):
        measured.main(["--device", "nosuch"])


def test_a_small_measurement_never_stands_for_the_real_one(home, monkeypatch):
    monkeypatch.delenv("MINILLM_QUICK", raising=False)
    assert measured.main(["--device", "cpu", "--quick"]) == 0  # small buffers, in a full-size session
    assert measured.load_profile("cpu") is None and measured.profile_path("cpu", small=True).is_file()
