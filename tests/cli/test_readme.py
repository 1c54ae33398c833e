"""Every command in the README is run by a test: a README example that fails is a failing test.

``readme_commands`` reads each shell command of the README's ``bash`` blocks. Each must appear in
exactly one of the tables below, which say how it is exercised:

- ``AS_WRITTEN``: run exactly as the README writes it (fast ones in CI's fast set, the model-heavy
  ones marked slow);
- ``SYNOPSES``: a synopsis (``[--flag VALUE]``, ``a | b``) is run as the listed instances;
- ``ELSEWHERE``: run by another test (named), or needing what these machines do not have (a
  Docker engine, a Kubernetes cluster), with the offline check that stands in for it.

A command added to the README without a row here fails ``test_every_readme_command_is_accounted_for``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SMOLLM2 = "smollm2-135m-instruct"
QWEN_GENERATE = [
    '.venv/bin/specserve generate --prompt "def quicksort(arr):" --max-tokens 128',
    (
        '.venv/bin/specserve generate --chat --prompt "Explain KV caches" --temperature 0.7 --seed 1 '
        "--max-tokens 256"
    ),
    '.venv/bin/specserve generate --prompt "def quicksort(arr):" --method draft --depth 6 --max-tokens 128',
    '.venv/bin/specserve generate --prompt "def quicksort(arr):" --method ngram --max-tokens 128',
]
AS_WRITTEN = {
    f'.venv/bin/specserve generate --model {SMOLLM2} --chat --prompt "Hi" --stop "."': "fast",
    ".venv/bin/specserve policies": "fast",
    ".venv/bin/python -m deploy.kuberay --overlay cpu": "fast",
    ".venv/bin/python -m deploy.kuberay --all --check": "fast",
    ".venv/bin/pytest tests/k8s -q": "fast",
    **dict.fromkeys(QWEN_GENERATE, "slow"),
}
SYNOPSES = {
    ".venv/bin/specserve models list | fetch NAME | path NAME": [
        ".venv/bin/specserve models list",
        f".venv/bin/specserve models fetch {SMOLLM2}",
        f".venv/bin/specserve models path {SMOLLM2}",
    ],
    ".venv/bin/specserve bench --policies [--real-loads 1 4 16] [--record-traces PATH]": [
        ".venv/bin/specserve bench --policies --out {tmp}",
    ],
    ".venv/bin/specserve bench [--model NAME] [--max-tokens 128] [--repeats 3] [--kinds code json]": [
        f".venv/bin/specserve bench --model {SMOLLM2} --max-tokens 8 --repeats 1 --kinds code --out {{tmp}}",
    ],
    # re-renders into a copy of the repository's overlays, not over the committed files
    ".venv/bin/python -m deploy.kuberay --all --write": [
        ".venv/bin/python -m deploy.kuberay --all --write --root {tmp}",
    ],
}
SERVED = "test_make_serve_then_the_readme_clients"  # runs these against `make serve`
AUTOSCALED = "tests/serve/test_autoscaling_e2e.py (the same settings through build_app: 1 -> 2 -> 1 replicas)"
SERVE_BUILD = "tests/serve/test_serve_entry.py (serve build; serve deploy of its output to a local cluster)"
ELSEWHERE = {
    "make serve": SERVED,
    (
        ".venv/bin/specserve serve [--model NAME] [--draft NAME] [--method draft|ngram|off] [--port 8000]"
    ): SERVED,
    "curl http://127.0.0.1:8000/v1/chat/completions": SERVED,
    (
        ".venv/bin/locust -f loadtest/locustfile.py --headless -u 4 -t 60s "
        "--host http://127.0.0.1:8000 CodeUser"
    ): SERVED,
    "make test": "CI itself (.ci/run runs it on a fresh clone)",
    (
        "SPECSERVE_AUTOSCALING__UPSCALE_DELAY_S=2 SPECSERVE_AUTOSCALING__DOWNSCALE_DELAY_S=10 "
        ".venv/bin/specserve serve --model smollm2-135m-instruct --method ngram --max-replicas 2 "
        "--replica-cpus 1"
    ): AUTOSCALED,
    "curl -s http://127.0.0.1:8000/metrics | grep '^specserve:num_requests_running'": AUTOSCALED,
    (
        "SPECSERVE_AUTOSCALING__UPSCALE_DELAY_S=5 SPECSERVE_AUTOSCALING__DOWNSCALE_DELAY_S=15 "
        "SPECSERVE_AUTOSCALING__REPLICA_NUM_CPUS=1 .venv/bin/specserve loadtest "
        "--model smollm2-135m-instruct --policies plain goodput --users 8 --ramp --max-replicas 2 "
        "--run-time 240"
    ): "tests/loadtest/test_ramp_e2e.py (the same on one policy, 6 users, 75 s, second-long delays)",
    (
        ".venv/bin/specserve loadtest --model smollm2-135m-instruct --method ngram --policies goodput "
        "--users 4 --min-replicas 2 --max-replicas 2 --run-time 90 --chaos kill-replica"
    ): "tests/loadtest/test_chaos_e2e.py (the same cell: 40 s, the kill at 0.3 of it)",
    (
        ".venv/bin/specserve loadtest --model smollm2-135m-instruct --method ngram --policies goodput "
        "--users 4 --run-time 90 --chaos restart-redis"
    ): "tests/loadtest/test_chaos.py (the Redis fault and its recovery; tests/serve/test_redis_outage_e2e.py "
    "under load)",
    ".venv/bin/specserve loadtest [--policies ...] [--users 1 4 16 32] [--mixes mixed] [--run-time 90]": (
        "tests/loadtest/test_smoke.py (an instance on SmolLM2: two policies, one load level, seconds)"
    ),
    ".venv/bin/specserve loadtest --policies plain static goodput --users 1 4 --run-time 60": (
        "tests/loadtest/test_smoke.py (the same command on SmolLM2 with fewer users and seconds)"
    ),
    (
        "SPECSERVE_MODEL__TARGET=smollm2-135m-instruct SPECSERVE_SPECULATION__METHOD=ngram "
        ".venv/bin/serve build serve_app.serve_entry:app -o serve_config.yaml"
    ): SERVE_BUILD,
    ".venv/bin/serve deploy serve_config.yaml -a http://HEAD_NODE:8265": SERVE_BUILD,
    ".venv/bin/serve status -a http://HEAD_NODE:8265": SERVE_BUILD,
}
NEEDS_A_CLUSTER = (  # docker / kubectl / helm / kind: no Docker engine or cluster on these machines
    "docker ",
    "kubectl ",
    "helm ",
    "kind ",
    "seq 400 | xargs",
)
CLUSTER_CHECK = "tests/k8s (manifests against the CRDs, the Dockerfile, the one source of truth)"


def readme_commands() -> list[str]:
    """The shell commands of the README's bash blocks: continuations joined, comments cut; a curl
    with a JSON body counts by its URL."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for command in re.sub(r"\\\n\s*", " ", block).splitlines():
            command = re.sub(r"\s+#\s.*$", "", command).strip()
            if not command or command.startswith("#") or command.startswith(('"', "-d", "}")):
                continue
            if command.startswith("curl "):
                command = command.split(" -H")[0]
            commands.append(re.sub(r"\s+", " ", command).rstrip(" &"))
    return commands


def how(command: str) -> str | None:
    if command in AS_WRITTEN:
        return "as written"
    if command in SYNOPSES:
        return "synopsis"
    if command in ELSEWHERE:
        return ELSEWHERE[command]
    if command.startswith(NEEDS_A_CLUSTER):
        return CLUSTER_CHECK
    return None


def test_every_readme_command_is_accounted_for() -> None:
    commands = readme_commands()
    assert len(commands) > 20  # the parser finds the README's commands
    assert [c for c in commands if how(c) is None] == []
    listed = {*AS_WRITTEN, *SYNOPSES, *ELSEWHERE}
    assert sorted(listed - set(commands)) == []  # no row for a command the README no longer has


def run(command: str, tmp: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    line = command.format(tmp=tmp)
    result = subprocess.run(line, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{line}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    return result


def _kuberay_root(tmp: Path) -> Path:
    shutil.copytree(ROOT / "k8s", tmp / "k8s")
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


FAST = [c for c, speed in AS_WRITTEN.items() if speed == "fast"] + [
    *SYNOPSES[".venv/bin/specserve models list | fetch NAME | path NAME"],
    *SYNOPSES[".venv/bin/python -m deploy.kuberay --all --write"],
]


@pytest.mark.pack(SMOLLM2)
@pytest.mark.parametrize("command", FAST)
def test_fast_readme_command(command: str, tmp_path: Path, smollm2_path: Path) -> None:
    tmp = _kuberay_root(tmp_path) if "--root" in command else tmp_path
    result = run(command, tmp)
    if "generate" in command:  # the Qwen default draft cannot draft for SmolLM2: one warning
        assert result.stdout.strip()
        assert result.stderr.count("does not share the tokenizer") == 1
    if command.endswith("models path " + SMOLLM2):
        assert Path(result.stdout.strip()) == smollm2_path


SLOW = [c for c, speed in AS_WRITTEN.items() if speed == "slow"] + [
    *SYNOPSES[".venv/bin/specserve bench --policies [--real-loads 1 4 16] [--record-traces PATH]"],
    *SYNOPSES[
        ".venv/bin/specserve bench [--model NAME] [--max-tokens 128] [--repeats 3] [--kinds code json]"
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("command", SLOW)
def test_model_heavy_readme_command(command: str, tmp_path: Path, qwen_pair: tuple[Path, Path]) -> None:
    result = run(command, tmp_path, timeout=900)
    assert result.stdout.strip()


def _python_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    return blocks[0]


def _curl_example() -> str:
    block = next(
        b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if b.startswith("curl ")
    )
    return block.strip()


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "make serve exited before it was healthy"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise AssertionError(f"{url} not healthy within {timeout:.0f} s")


@pytest.mark.slow
def test_make_serve_then_the_readme_clients(tmp_path: Path, qwen_pair: tuple[Path, Path]) -> None:
    """`make serve` (= `specserve serve` with the defaults, the Qwen pair, port 8000), then the
    README's curl, its Python client and its by-hand Locust line (for seconds, not a minute)."""
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(
        ["make", "serve"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        _wait_healthy("http://127.0.0.1:8000/health", process, timeout=600)
        curl = subprocess.run(_curl_example(), shell=True, capture_output=True, text=True, timeout=300)
        assert curl.returncode == 0 and '"speculation"' in curl.stdout and "[DONE]" in curl.stdout
        client = subprocess.run(
            [sys.executable, "-c", _python_snippet()], capture_output=True, text=True, timeout=300
        )
        assert client.returncode == 0 and "def " in client.stdout, client.stderr[-2000:]
        locust = ROOT / ".venv/bin/locust"
        by_hand = (
            f"{locust} -f loadtest/locustfile.py --headless -u 4 -t 5s --host http://127.0.0.1:8000 CodeUser"
        )
        run(by_hand, tmp_path)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
    assert "[specserve] shutting down" in (tmp_path / "serve.log").read_text()
