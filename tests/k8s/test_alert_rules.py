"""k8s/monitoring as Prometheus itself reads it, where ``promtool`` is installed (or named by the
PROMTOOL variable; Debian's `prometheus` package has it): every alert and dashboard expression parses,
and each alert fires on the series it exists for and stays quiet on the ones it does not."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.helpers import find
from tests.k8s.test_monitoring import dashboard, dashboard_queries

# Grafana's variables, as Grafana substitutes them before the query reaches Prometheus.
GRAFANA = {"$__rate_interval": "1m", "$model": ".*", "$replica": ".*"}
SPEC = 'model_name="m", replica="r0", proposer="draft", policy="auto"'
ENGINE = 'model_name="m", replica="r0"'


def promtool() -> str:
    path = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not path:
        pytest.skip("promtool is not installed (PROMTOOL names one); the expressions are not parsed")
    return path


def run(tool: str, *args: str, cwd: Path) -> None:
    out = subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def scenario(series: dict[str, str], alert: str, eval_time: str, fires: bool) -> dict[str, Any]:
    """One promtool unit test: ``series`` (name{labels} -> values) and whether ``alert`` fires (for
    model ``m``; the rule's own labels are added by the test)."""
    labels = {"model_name": "m"}
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [
            {
                "eval_time": eval_time,
                "alertname": alert,
                "exp_alerts": [{"exp_labels": labels}] if fires else [],
            }
        ],
    }


def rule_scenarios() -> list[dict[str, Any]]:
    drafts = f"specserve:spec_decode_num_drafts_total{{{SPEC}}}"
    drafted = f"specserve:spec_decode_num_draft_tokens_total{{{SPEC}}}"
    accepted = f"specserve:spec_decode_num_accepted_tokens_total{{{SPEC}}}"
    waiting = f"specserve:num_requests_waiting{{{ENGINE}}}"
    running = f"specserve:num_requests_running{{{ENGINE}}}"
    refused = f'specserve:requests_refused_total{{{ENGINE}, reason="engine_queue_full"}}'
    finished = f'specserve:request_success_total{{{ENGINE}, finished_reason="stop"}}'
    collapse = {drafts: "0+60x480", drafted: "0+300x480"}
    steady = {**collapse, accepted: "0+240x480"}  # 80% accepted throughout
    dropped = {**collapse, accepted: "0+240x360 86400+30x120"}  # 80%, then 10% from the 6th hour
    idle = {drafts: "0x480", drafted: "0x480", accepted: "0x480"}
    return [
        scenario(dropped, "SpecserveAcceptanceCollapse", "420m", True),
        scenario(steady, "SpecserveAcceptanceCollapse", "420m", False),
        scenario(idle, "SpecserveAcceptanceCollapse", "420m", False),  # no drafts, no alert
        scenario({waiting: "0+1x60"}, "SpecserveQueueGrowing", "40m", True),
        scenario({waiting: "5x60"}, "SpecserveQueueGrowing", "40m", False),
        scenario({waiting: "10x40", running: "4x40"}, "SpecserveQueueBacklog", "30m", True),
        scenario({waiting: "3x40", running: "8x40"}, "SpecserveQueueBacklog", "30m", False),
        scenario({waiting: "12x40", running: "16x40"}, "SpecserveQueueBacklog", "30m", False),
        scenario({refused: "0+60x30", finished: "0+540x30"}, "SpecserveHighRefusalRate", "20m", True),
        scenario({refused: "0+60x30"}, "SpecserveHighRefusalRate", "20m", True),  # nothing finishes
        scenario({refused: "0+6x30", finished: "0+594x30"}, "SpecserveHighRefusalRate", "20m", False),
    ]


def test_alerts_fire_on_what_they_exist_for(monitoring: list[dict[str, Any]], tmp_path: Path) -> None:
    tool = promtool()
    groups = copy.deepcopy(find(monitoring, "PrometheusRule")["spec"]["groups"])  # a session fixture
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # templated text: the labels and the timing are under test
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    tests = rule_scenarios()
    for test in tests:  # an alert carries its rule's labels, and the acceptance one its proposer
        for check in test["alert_rule_test"]:
            rule = next(r for g in groups for r in g["rules"] if r["alert"] == check["alertname"])
            for expected in check["exp_alerts"]:
                expected["exp_labels"]["severity"] = rule["labels"]["severity"]
                if check["alertname"] == "SpecserveAcceptanceCollapse":
                    expected["exp_labels"]["proposer"] = "draft"
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec))
    run(tool, "check", "rules", "rules.yaml", cwd=tmp_path)
    run(tool, "test", "rules", "test.yaml", cwd=tmp_path)


def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    tool = promtool()
    rules = []
    for i, (_, expr) in enumerate(dashboard_queries(dashboard())):
        for variable, value in GRAFANA.items():
            expr = expr.replace(variable, value)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    (tmp_path / "dashboard.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    )
    run(tool, "check", "rules", "dashboard.yaml", cwd=tmp_path)
