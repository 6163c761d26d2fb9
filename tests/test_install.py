"""One install: requirements.txt, pyproject.toml, .ci/run, README ("First 10 minutes" and "Install") and
tools/doctor.py name the same versions and commands; and README's commands resolve on the public index to them."""

import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import doctor  # noqa: E402

PYPI = ("pypi.org", 443)
PYTORCH_INDEX = ("download.pytorch.org", 443)
DRY_RUN_TIMEOUT_S = 300  # about 30 s here; pyproject.toml's per-test limit is 600 s


def requirements() -> dict[str, Requirement]:
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            requirement = Requirement(text)
            found[requirement.name] = requirement
    return found


def readme_section(title: str) -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index(f"\n## {title}\n"):]
    return section[: section.index("\n## ", 1)]


@pytest.mark.parametrize(("version", "admitted"), [
    ("2.11.0+cu130", True),  # the GPU runs
    ("2.11.0", True),  # PyPI's name for the same CUDA 13.0 build
    ("2.13.0+cpu", True),  # CI
    ("2.13.0", True),
    ("2.12.1", False),  # never tested
    ("2.10.0", False),
    ("2.13.1", False),
    ("2.14.0", False),
])
def test_torch_range_admits_the_tested_builds_only(version, admitted):
    assert requirements()["torch"].specifier.contains(version) is admitted


def test_triton_is_pinned_to_the_tested_release():
    triton = requirements()["triton"]
    assert str(triton.specifier) == "==3.6.0" and doctor.TRITON == "3.6.0"
    assert triton.marker is not None and 'platform_system == "Linux"' in str(triton.marker)


def test_ci_installs_the_cpu_torch_first_then_the_requirements():
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert commands[0].endswith("pip install -q torch==2.13.0")
    assert commands[1].endswith("pip install -q -r requirements.txt") and len(commands) == 2
    assert requirements()["torch"].specifier.contains("2.13.0+cpu")  # so the second line keeps the first one's torch


def test_pyproject_declares_the_project_its_python_and_requirements_txt():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["requires-python"] == ">={}.{}".format(*doctor.MIN_PYTHON)
    assert project["dynamic"] == ["dependencies"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}


def test_readme_requirements_and_doctor_give_the_same_commands():
    assert doctor.CUDA_INSTALL == "pip install torch==2.11.0 -r requirements.txt"
    assert doctor.CPU_INSTALL == "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -r requirements.txt"
    torch = requirements()["torch"].specifier
    assert {str(spec) for spec in torch} == {f">={doctor.MIN_TORCH}", f"<={doctor.MAX_TORCH}", "!=2.12.*"}
    assert (doctor.GPU_TORCH, doctor.CPU_TORCH) == ("2.11", "2.13")
    header = (ROOT / "requirements.txt").read_text()
    first_10_minutes, install = readme_section("First 10 minutes"), readme_section("Install")
    cpu_steps = doctor.CPU_INSTALL.split(" && ")
    for text in (first_10_minutes, install, header):
        assert doctor.CUDA_INSTALL in text and all(step in text for step in cpu_steps)
    assert "`torch>=2.11,<=2.13.0,!=2.12.*`" in install and "`triton==3.6.0`" in install
    assert re.search(r"\| CUDA machines .*\| 2\.11\.0\b.*\| 3\.6\.0 \|", install)
    assert re.search(r"\| CPU-only machines and CI \| 2\.13\.0 \(CPU build\) \| 3\.6\.0 \(.*\|", install)


def test_the_installed_packages_satisfy_the_requirements():
    """What CI gets from `.ci/run` (and a GPU machine from the README's steps) is what requirements.txt names."""
    for name, requirement in requirements().items():
        if requirement.marker is None or requirement.marker.evaluate():
            installed = importlib.metadata.version(name)
            assert requirement.specifier.contains(installed), f"{name} {installed}"


# ----- README's commands against the public index (pip's --dry-run: nothing is installed or downloaded in full) -----


def reachable(address: tuple[str, int]) -> str | None:
    """None when a TCP connection to address opens within 10 s, else why not."""
    try:
        socket.create_connection(address, timeout=10).close()
    except OSError as error:
        return f"{address[0]}:{address[1]} is unreachable from this machine ({error})"
    return None


def dry_run(*args: str, ignore_installed: bool = True) -> dict[str, str]:
    """name -> version of what `pip install ARGS` would install, asked of the public index alone: no pip
    configuration (this machine's points at local wheels and constraints), no PIP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--isolated", "--quiet", "--report", "-", "--disable-pip-version-check"]
    try:
        result = subprocess.run([*command, *(["--ignore-installed"] if ignore_installed else []), *args], capture_output=True,
                                text=True, cwd=ROOT, env=env, timeout=DRY_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # reachable, but no answer in time: a slow index, or pip's resolver backtracking
        pytest.skip(f"pip's dry run of `pip install {' '.join(args)}` did not finish within {DRY_RUN_TIMEOUT_S} s: a slow index "
                    "or a resolver that backtracks; run it by hand to tell")
    assert result.returncode == 0, result.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(result.stdout)["install"]}


@pytest.mark.slow
def test_readme_cuda_command_resolves_on_pypi_to_the_tested_gpu_versions():
    unreachable = reachable(PYPI)
    if unreachable:
        pytest.skip(unreachable)
    resolved = dry_run(*doctor.CUDA_INSTALL.removeprefix("pip install ").split())
    assert resolved["torch"] == "2.11.0" and resolved["triton"] == "3.6.0"  # PyPI's torch 2.11.0 is the CUDA 13.0 build
    assert any(name.startswith("nvidia-") for name in resolved)
    assert {name.lower() for name in requirements()} <= set(resolved)


@pytest.mark.slow
def test_readme_cpu_command_keeps_the_cpu_build_on_pypi():
    """The CPU command's second step, where its first one has put the CPU build of 2.13.0 (as .ci/run does here)."""
    if not importlib.metadata.version("torch").endswith("+cpu"):
        pytest.skip(f"torch {importlib.metadata.version('torch')} is not a CPU build")
    unreachable = reachable(PYPI)
    if unreachable:
        pytest.skip(unreachable)
    resolved = dry_run(*doctor.CPU_INSTALL.split(" && ")[1].removeprefix("pip install ").split(), ignore_installed=False)
    assert "torch" not in resolved and not any(name.startswith("nvidia-") for name in resolved), resolved


@pytest.mark.slow
def test_readme_cpu_command_finds_the_cpu_build_on_pytorchs_index():
    unreachable = reachable(PYTORCH_INDEX)
    if unreachable:
        pytest.skip(unreachable)
    resolved = dry_run(*doctor.CPU_INSTALL.split(" && ")[0].removeprefix("pip install ").split())
    assert resolved["torch"] == "2.13.0+cpu" and "triton" not in resolved
