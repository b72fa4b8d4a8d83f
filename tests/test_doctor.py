from minillm.machine import doctor


def test_checks_pass_on_a_working_install():
    checks = doctor.run_checks()
    assert not [c for c in checks if c.ok is False], doctor.report(checks)
    assert doctor.report(checks).endswith("Ready.")


def test_a_missing_package_fails_with_a_fix():
    check = doctor.check_packages(("numpy", "surely_not_a_module_xyz"))
    assert check.ok is False and "surely_not_a_module_xyz" in check.detail and "pip install" in check.fix
    assert "Fix these first: packages" in doctor.report([check])


def test_banner_names_device_and_mode(monkeypatch):
    monkeypatch.setenv("MINILLM_QUICK", "1")
    banner = doctor.run_banner(preset="tiny")
    assert "QUICK" in banner and "device" in banner and "preset: tiny" in banner
    monkeypatch.setenv("MINILLM_QUICK", "0")
    assert "full" in doctor.run_banner()
