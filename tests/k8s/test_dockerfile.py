"""The Dockerfile builds the image the manifests run, installing as the README does (no docker
daemon here: the file is parsed and its facts checked against the manifests and the Makefile)."""

from __future__ import annotations

import re

import pytest

from deploy import manifest
from tests.k8s.helpers import REPO


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in instructions() if word == "ARG" and "=" in rest)


def stages() -> list[str]:
    return [rest for word, rest in instructions() if word == "FROM"]


def test_stages_build_on_python_311_slim() -> None:
    assert args()["PYTHON_IMAGE"] == "python:3.11-slim"
    assert stages() == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS runtime"]


def test_installs_with_make_install_as_the_readme() -> None:
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert "make install" in runs and "TORCH_WHEELS=/opt/wheels" in runs
    assert ("COPY", ". /app") in instructions()
    readme = (REPO / "README.md").read_text()
    assert "make" in readme and "make install" in (REPO / "Dockerfile").read_text()


def test_torch_is_the_makefiles_pin_from_the_cpu_index() -> None:
    makefile = (REPO / "Makefile").read_text()
    pin = re.search(r"^TORCH_PIN := torch==(\S+)$", makefile, re.M)
    assert pin and args()["TORCH_VERSION"] == pin.group(1)
    assert args()["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in runs


def test_ray_version_is_the_rayservices() -> None:
    assert args()["RAY_VERSION"] == manifest.RAY_VERSION
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert 'echo "ray==${RAY_VERSION}"' in runs and "PIP_CONSTRAINT=" in runs
    assert "assert ray.__version__ == '${RAY_VERSION}'" in runs


def test_runtime_runs_as_the_pods_user_with_the_venv_on_path() -> None:
    steps = instructions()
    runtime = steps[[i for i, (w, _) in enumerate(steps) if w == "FROM"][1] :]
    assert ("USER", str(manifest.RAY_UID)) in runtime
    assert any(w == "COPY" and "--from=build" in r and "/app /app" in r for w, r in runtime)
    assert any(w == "ENV" and "PATH=/app/.venv/bin:$PATH" in r for w, r in runtime)
    # KubeRay's `bash -lc ray start ...`: a login shell must find the venv as well
    assert any(w == "RUN" and "/etc/profile.d/" in r and "/app/.venv/bin" in r for w, r in runtime)
    assert any(w == "RUN" and "wget" in r for w, r in runtime)  # the probes use it


@pytest.mark.parametrize("pattern", [".git", ".venv", "**/__pycache__"])
def test_dockerignore_keeps_local_state_out(pattern: str) -> None:
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    assert pattern in lines
