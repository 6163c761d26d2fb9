"""One install: requirements.txt, .ci/run, README's Install table and tools/doctor.py name the same versions."""

import importlib.metadata
import re
import sys

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import doctor  # noqa: E402


def requirements() -> dict[str, Requirement]:
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            requirement = Requirement(text)
            found[requirement.name] = requirement
    return found


@pytest.mark.parametrize(("version", "admitted"), [
    ("2.11.0+cu130", True),  # the GPU runs
    ("2.13.0+cpu", True),  # CI
    ("2.13.0", True),
    ("2.12.1", True),
    ("2.10.0", False),
    ("2.13.1", False),  # with no torch installed, pip must take 2.13.0, not a newer (CUDA) release
    ("2.14.0", False),
])
def test_torch_range_admits_the_tested_builds_only(version, admitted):
    assert requirements()["torch"].specifier.contains(version) is admitted


def test_triton_is_pinned_to_the_tested_release():
    triton = requirements()["triton"]
    assert str(triton.specifier) == "==3.6.0" and doctor.TRITON == "3.6.0"
    assert triton.marker is not None and 'platform_system == "Linux"' in str(triton.marker)


def test_ci_installs_the_cpu_torch_first_then_the_requirements():
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pip install" in line]
    assert commands[0].endswith("pip install -q torch==2.13.0")
    assert commands[1].endswith("pip install -q -r requirements.txt") and len(commands) == 2
    assert requirements()["torch"].specifier.contains("2.13.0")  # so the second line keeps the first one's torch


def test_doctor_and_readme_name_the_same_versions():
    torch = requirements()["torch"].specifier
    assert {str(spec) for spec in torch} == {f">={doctor.MIN_TORCH}", f"<={doctor.MAX_TORCH}"}
    assert (doctor.GPU_TORCH, doctor.CPU_TORCH) == ("2.11", "2.13")
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):]
    install = install[: install.index("\n## ", 1)]
    assert "`torch>=2.11,<=2.13.0`" in install and "`triton==3.6.0`" in install
    assert re.search(r"\| GPU runs .*\| 2\.11 .*\| 3\.6\.0 \|", install)
    assert re.search(r"\| CPU machines and CI \| 2\.13\.0 \(CPU build\) \| 3\.6\.0 \|", install)


def test_the_installed_packages_satisfy_the_requirements():
    """What CI gets from `.ci/run` (and a GPU machine from the README's steps) is what requirements.txt names."""
    for name in ("torch", "triton"):
        installed = importlib.metadata.version(name)
        assert requirements()[name].specifier.contains(installed), f"{name} {installed}"
