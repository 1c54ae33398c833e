"""``serve_app.serve_entry:app``, the module-level application, through Ray's own command line:
``serve build`` writes a config that carries our deployment options, and (slow, on a separate local
Ray cluster with a dashboard) ``serve deploy`` of that config serves SmolLM2 over HTTP.

The round trip starts its own cluster with ``ray start --head`` in a new process session, on free
ports (never 6379: Redis's) and its own temp dir, so the in-process cluster of the other serve tests
never sees it; at the end Serve is shut down and the cluster stopped by killing that session's
process group, not with ``ray stop``, which stops every Ray process on the machine, other test
sessions' included. Token authentication is off for that throwaway loopback cluster, so that no
token is read or written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from serve_app.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, deployment_options, ingress_options
from serve_app.config import build_settings

BIN = Path(sys.executable).parent
IMPORT_PATH = "serve_app.serve_entry:app"
MODEL = "smollm2"
MAX_SEQ_LEN = 512
# The end-to-end tests' application (tests/serve/test_app_e2e.py), given as the environment: SmolLM2
# as target and as its own draft in float32, the static policy, so every request drafts.
SETTINGS_ENV = {
    "SPECSERVE_MODEL__TARGET": "smollm2-135m-instruct",
    "SPECSERVE_MODEL__DRAFT": "smollm2-135m-instruct",
    "SPECSERVE_RUNTIME__DTYPE": "float32",
    "SPECSERVE_RUNTIME__THREADS": "2",
    "SPECSERVE_CACHE__MAX_SLOTS": "4",
    "SPECSERVE_CACHE__MAX_SEQ_LEN": str(MAX_SEQ_LEN),
    "SPECSERVE_SPECULATION__METHOD": "draft",
    "SPECSERVE_SPECULATION__DEPTH": "4",
    "SPECSERVE_SPECULATION__POLICY": "static",
    "SPECSERVE_SPECULATION__PROPOSERS__DRAFT__INT8": "false",
    "SPECSERVE_SERVER__SERVED_MODEL_NAME": MODEL,
    "SPECSERVE_AUTOSCALING__REPLICA_NUM_CPUS": "1",
    "SPECSERVE_AUTOSCALING__MAX_QUEUED_REQUESTS": "16",
    "SPECSERVE_AUTOSCALING__MAX_INGRESS_REPLICAS": "2",
}


def settings_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the test's settings (and no RAY_ADDRESS: every Ray command
    here names its cluster)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, **SETTINGS_ENV, **(extra or {})}


def serve_build(env: dict[str, str], output: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "serve"), "build", IMPORT_PATH, "-o", str(output)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def built_config(env: dict[str, str], output: Path) -> dict[str, Any]:
    done = serve_build(env, output)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(output.read_text())


# --------------------------------------------------------------------------------- serve build


def test_importing_the_entry_binds_the_app_and_starts_nothing() -> None:
    code = (
        "import sys, ray; from ray import serve; import serve_app.serve_entry as entry; "
        "print(isinstance(entry.app, serve.Application), ray.is_initialized(), 'torch' in sys.modules)"
    )
    env = settings_env()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # an Application; no Ray cluster; torch never imported, so no model was loaded
    assert done.stdout.split() == ["True", "False", "False"]


def test_serve_build_writes_our_options_and_an_import_path_that_rebuilds_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = settings_env()
    config = built_config(env, tmp_path / "serve_config.yaml")
    (app,) = config["applications"]
    assert app["import_path"] == IMPORT_PATH and not app.get("args")  # an Application takes no args
    for name, value in SETTINGS_ENV.items():  # the settings `serve build` saw, read the same way
        monkeypatch.setenv(name, value)
    settings = build_settings()
    deployments = {d["name"]: d for d in app["deployments"]}
    expected = {
        ENGINE_DEPLOYMENT: deployment_options(settings),
        INGRESS_DEPLOYMENT: ingress_options(settings),
    }
    assert set(deployments) == set(expected)
    for name, options in expected.items():
        written = {k: v for k, v in deployments[name].items() if k != "name"}
        assert written == options, name  # every option, nothing else
    assert deployments[INGRESS_DEPLOYMENT]["autoscaling_config"]["max_replicas"] == 2
    assert deployments[ENGINE_DEPLOYMENT]["health_check_period_s"] > 0


def test_serve_build_refuses_invalid_settings_naming_the_field(tmp_path: Path) -> None:
    done = serve_build(settings_env({"SPECSERVE_CACHE__MAX_SLOTS": "0"}), tmp_path / "bad.yaml")
    assert done.returncode != 0 and "max_slots" in done.stderr
    assert not (tmp_path / "bad.yaml").exists()


# --------------------------------------------------------------------------------- round trip


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (held together while chosen, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def stop_process_group(pgid: int, grace_s: float = 15.0) -> None:
    """SIGTERM every process of the group, then SIGKILL what is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # raises ProcessLookupError once the group is gone
            time.sleep(0.5)
        os.killpg(pgid, signal.SIGKILL)


def ray_env() -> dict[str, str]:
    """The environment of the test cluster and of the commands that talk to it: no settings (they
    travel in the config's runtime_env), no RAY_ADDRESS, and no token authentication, so that
    nothing reads or writes a token for this throwaway cluster on the loopback address."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("SPECSERVE_")}
    return {**env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def dashboard_cluster() -> Iterator[str]:
    """A separate local Ray cluster with its dashboard (``serve deploy`` talks to its REST API);
    yields the dashboard's URL."""
    gcs, dashboard, agent, agent_grpc, runtime_env, metrics, client, node, objects = free_ports(9)
    # Short: Ray's unix socket paths live under it and must stay under 108 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ssrt", dir="/tmp")
    command = [
        str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
        f"--ray-client-server-port={client}", f"--node-manager-port={node}",
        f"--object-manager-port={objects}", "--num-cpus=2", "--object-store-memory=200000000",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]  # fmt: skip
    # A new session: Ray's daemons (GCS, raylet, dashboard, agents) stay in its process group, which
    # is how they stop; workers make groups of their own but exit when their raylet goes.
    start = subprocess.Popen(
        command, env=ray_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = start.communicate(timeout=240)
        assert start.returncode == 0, f"ray start failed:\n{out.decode(errors='replace')[-3000:]}"
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        stop_process_group(start.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    """Call ``probe`` until it returns something true (exceptions count as not yet); return it."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            if result := probe():
                return result
        except (requests.RequestException, ValueError) as exc:
            last = exc
        time.sleep(1.0)
    pytest.fail(f"{what}: not within {timeout:.0f} s (last error: {last})")


def serve_cli(*args: str) -> None:
    done = subprocess.run(
        [str(BIN / "serve"), *args], env=ray_env(), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, f"serve {args[0]}: {done.stdout[-2000:]}{done.stderr[-4000:]}"


def application(dashboard: str) -> dict[str, Any]:
    """The one application's details from the dashboard's Serve REST API; fails on a failed deploy."""
    apps = requests.get(f"{dashboard}/api/serve/applications/", timeout=10).json()["applications"]
    if not apps:  # the controller has not taken the config yet
        return {}
    (details,) = apps.values()
    assert details["status"] not in ("DEPLOY_FAILED", "UNHEALTHY"), details.get("message")
    return details if details["status"] == "RUNNING" else {}


@pytest.mark.slow
@pytest.mark.pack("smollm2-135m-instruct")
def test_serve_build_then_serve_deploy_round_trip(smollm2_path: Path, tmp_path: Path) -> None:
    env = settings_env()
    config = built_config(env, tmp_path / "serve_config.yaml")
    # The two edits a user makes: where Serve listens, and the settings for the import on the
    # cluster (serve_app.serve_entry builds them from the environment there).
    port = free_ports(1)[0]
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["runtime_env"] = {"env_vars": {k: v for k, v in env.items() if k.startswith("SPECSERVE_")}}
    deploy_file = tmp_path / "deploy.yaml"
    deploy_file.write_text(yaml.safe_dump(config, sort_keys=False))
    base = f"http://127.0.0.1:{port}"

    with dashboard_cluster() as dashboard:
        serve_cli("deploy", str(deploy_file), "-a", dashboard)
        try:
            details = wait_for("the application RUNNING", lambda: application(dashboard), 420)
            ingress = details["deployments"][INGRESS_DEPLOYMENT]["deployment_config"]
            assert ingress["autoscaling_config"]["max_replicas"] == 2  # the file's options, live
            wait_for("/health", lambda: requests.get(f"{base}/health", timeout=10).status_code == 200, 60)
            cards = requests.get(f"{base}/v1/models", timeout=30).json()["data"]
            # the served name and the context length: the build's settings reached the replicas
            assert [c["id"] for c in cards] == [MODEL] and cards[0]["max_model_len"] == MAX_SEQ_LEN
            body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0.0}
            response = requests.post(f"{base}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            result = response.json()
            assert result["choices"][0]["text"] and 0 < result["usage"]["completion_tokens"] <= 12
            assert result["speculation"]["proposer"] == "draft" and result["speculation"]["drafted"] > 0
        finally:
            serve_cli("shutdown", "-a", dashboard, "-y")
