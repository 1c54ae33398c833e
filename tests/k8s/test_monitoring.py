"""k8s/monitoring and the collector's metrics: the dashboard and the alerts reference only the metrics
the server exports (with labels those metrics carry), every panel has a data source and a query, the
monitors select what KubeRay creates for our RayService, and the collector's metrics pipeline is
wired to the serve Service and a configurable backend."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from serve_app.observability import metric_names as mn
from tests.k8s.helpers import K8S, find, pod_templates
from tests.k8s.promql import problems, references

DASHBOARD = K8S / "monitoring" / "dashboard.json"
# Every sample name a scrape of GET /metrics shows, with the labels it carries (`le`: buckets only).
LABELS_BY_SAMPLE: dict[str, frozenset[str]] = {
    sample: frozenset(spec.tag_keys) | ({"le"} if sample.endswith("_bucket") else frozenset())
    for spec in mn.METRICS
    for sample in spec.exported_names()
}
ALERTS = {
    "SpecserveAcceptanceCollapse",
    "SpecserveQueueGrowing",
    "SpecserveQueueBacklog",
    "SpecserveHighRefusalRate",
}
# Panels that count or refuse across replicas on purpose (a refusal by Serve's queue has no replica).
NOT_BY_REPLICA = {"Replicas", "Engine replicas", "Refused", "Refusals"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel but rows, those inside collapsed rows too."""
    out = []
    for panel in dash["panels"]:
        out.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return out


def variable_query(variable: dict[str, Any]) -> str | None:
    """The PromQL inside a query variable (``label_values(<selector>, label)``), or None."""
    query = variable.get("query")
    query = query.get("query") if isinstance(query, dict) else query
    if variable["type"] != "query":
        return None
    match = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)
    assert match, f"variable {variable['name']}: {query!r} is not label_values(<selector>, <label>)"
    return match.group(1)


def dashboard_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """``(where, PromQL)`` for every panel target and every query variable."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in panels(dash) for t in p["targets"]]
    for variable in dash["templating"]["list"]:
        if (query := variable_query(variable)) is not None:
            out.append((f"variable {variable['name']}", query))
    return out


def alert_rules(monitoring: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rule = find(monitoring, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


# --------------------------------------------------------------------------------- PromQL names


def test_catalogue_is_what_a_scrape_shows() -> None:
    assert set(LABELS_BY_SAMPLE) == mn.exported_sample_names()
    assert LABELS_BY_SAMPLE[mn.SPEC_DEPTH + "_bucket"] >= {"proposer", "le"}


def test_dashboard_references_only_exported_metrics() -> None:
    queries = dashboard_queries(dashboard())
    assert len(queries) > 40
    found = {where: p for where, expr in queries if (p := problems(expr, LABELS_BY_SAMPLE))}
    assert found == {}


def test_alerts_reference_only_exported_metrics(monitoring: list[dict[str, Any]]) -> None:
    found = {r["alert"]: p for r in alert_rules(monitoring) if (p := problems(r["expr"], LABELS_BY_SAMPLE))}
    assert found == {}


def test_checker_catches_a_misspelled_name_and_a_missing_label(monitoring: list[dict[str, Any]]) -> None:
    where, expr = next((w, e) for w, e in dashboard_queries(dashboard()) if "num_draft_tokens_total" in e)
    misspelled = expr.replace("num_draft_tokens_total", "num_drafted_tokens_total")
    assert problems(misspelled, LABELS_BY_SAMPLE) == [
        "unknown metric 'specserve:spec_decode_num_drafted_tokens_total'"
    ], where
    rule = alert_rules(monitoring)[0]["expr"].replace("_total[6h]", "[6h]")  # a counter without _total
    assert any("unknown metric" in p for p in problems(rule, LABELS_BY_SAMPLE))
    generated = "specserve:generation_tokens_total"
    assert problems(f"sum by (proposer) (rate({generated}[5m]))", LABELS_BY_SAMPLE) == [
        f"grouping by ['proposer'], which none of ['{generated}'] has"
    ]
    assert problems(f'{mn.NUM_DRAFTS}_total{{position="0"}}', LABELS_BY_SAMPLE) == [
        f"'{mn.NUM_DRAFTS}_total' has no label ['position']"
    ]
    assert problems("sum(rate(up[5m])) > 0", LABELS_BY_SAMPLE) == ["unknown metric 'up'"]
    assert problems("vector(1)", LABELS_BY_SAMPLE) == ["no metric name in 'vector(1)'"]


def test_reader_skips_functions_keywords_labels_and_ranges() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a:b_bucket{x=~"$m", y!="c"}[$__rate_interval])))'
        " > bool 1e3 and on (x) group_left (z) c offset 5m"
        ' unless count_values("v", max_over_time(d[10m:1m])) or -inf * vector(0)'
        ' or {__name__="e", k="v"} @ 1609746000 or sum without(w) (f) / ignoring(q) g'
    )
    refs = references(expr)
    assert refs.names == {"a:b_bucket", "c", "d", "e", "f", "g"}
    assert refs.grouping == {"le", "x", "z", "w", "q"}
    assert ("a:b_bucket", frozenset({"x", "y"})) in refs.selectors
    assert ("e", frozenset({"k"})) in refs.selectors
    with pytest.raises(ValueError, match="unbalanced"):
        references("sum(rate(x[5m])")


# --------------------------------------------------------------------------------- dashboard


def test_every_panel_has_a_datasource_and_a_query() -> None:
    dash = dashboard()
    (source,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert source["query"] == "prometheus"
    uid = "${" + source["name"] + "}"
    found = panels(dash)
    assert len(found) >= 20
    for panel in found:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"] == panel["datasource"], panel["title"]


def test_dashboard_layout_has_no_overlap() -> None:
    dash = dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_query_follows_the_model_and_replica_variables() -> None:
    dash = dashboard()
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "model", "replica"]
    for variable in dash["templating"]["list"][1:]:
        assert variable["includeAll"] and variable["allValue"] == ".*", variable["name"]
    unfiltered = set()
    for panel in panels(dash):
        for target in panel["targets"]:
            assert target["expr"].count('model_name=~"$model"') == target["expr"].count("specserve:")
            if 'replica=~"$replica"' not in target["expr"]:
                unfiltered.add(panel["title"])
    assert unfiltered == NOT_BY_REPLICA


def test_dashboard_shows_speculation_and_serving() -> None:
    used = set().union(*(references(expr).names for _, expr in dashboard_queries(dashboard())))
    speculation = {
        mn.NUM_ACCEPTED_TOKENS + "_total",
        mn.NUM_DRAFT_TOKENS + "_total",
        mn.NUM_DRAFTS + "_total",
        mn.NUM_ACCEPTED_TOKENS_PER_POS + "_total",
        mn.FALLBACKS + "_total",
        mn.SPEC_DEPTH + "_bucket",
        mn.BATCH_SIZE + "_bucket",
    }
    serving = {
        mn.TTFT + "_bucket",
        mn.ITL + "_bucket",
        mn.E2E + "_bucket",
        mn.GENERATION_TOKENS + "_total",
        mn.PROMPT_TOKENS + "_total",
        mn.NUM_RUNNING,
        mn.NUM_WAITING,
        mn.KV_CACHE_USAGE,
        mn.REQUESTS_REFUSED + "_total",
        mn.EXACT_MODE,
    }
    assert speculation | serving <= used
    replicas = [p for p in panels(dashboard()) if p["title"] in ("Replicas", "Engine replicas")]
    assert len(replicas) == 2  # the overview's figure and the curve
    for panel in replicas:
        refs = references(panel["targets"][0]["expr"])
        assert refs.names == {mn.NUM_RUNNING} and refs.grouping == {"replica"}  # distinct replica values


def test_dashboard_config_map_is_the_file(monitoring: list[dict[str, Any]]) -> None:
    config_map = find(monitoring, "ConfigMap", "specserve-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # what Grafana's sidecar watches
    (text,) = config_map["data"].values()
    assert text == DASHBOARD.read_text()
    assert len(text.encode()) < 256 * 1024  # kubectl apply's last-applied annotation limit


# --------------------------------------------------------------------------------- alerts


def test_alerts_are_complete(monitoring: list[dict[str, Any]]) -> None:
    rules = {r["alert"]: r for r in alert_rules(monitoring)}
    assert set(rules) == ALERTS
    for name, rule in rules.items():
        assert rule["for"] and rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    collapse = references(rules["SpecserveAcceptanceCollapse"]["expr"])
    assert mn.NUM_DRAFTS + "_total" in collapse.names  # only while drafts happen
    assert "[6h]" in rules["SpecserveAcceptanceCollapse"]["expr"]  # against its own longer level
    refusal = references(rules["SpecserveHighRefusalRate"]["expr"]).names
    assert refusal == {mn.REQUESTS_REFUSED + "_total", mn.REQUEST_SUCCESS + "_total"}
    for name in ("SpecserveQueueGrowing", "SpecserveQueueBacklog"):
        assert mn.NUM_WAITING in references(rules[name]["expr"]).names


# --------------------------------------------------------------------------------- monitors


def serve_port(rayservice: dict[str, Any]) -> int:
    head = pod_templates(rayservice)["head"]["spec"]["containers"][0]
    return next(p["containerPort"] for p in head["ports"] if p["name"] == "serve")


def test_service_monitor_scrapes_the_serve_service_once(
    monitoring: list[dict[str, Any]], rayservice: dict[str, Any]
) -> None:
    """KubeRay labels the serve Service ``ray.io/serve: <rayservice>-serve`` and gives it the head
    container's port named ``serve``; every pod behind it answers for the whole cluster, so one is
    kept: the head."""
    spec = find(monitoring, "ServiceMonitor")["spec"]
    assert spec["selector"]["matchLabels"]["ray.io/serve"] == rayservice["metadata"]["name"] + "-serve"
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] == "serve" and endpoint["path"] == "/metrics"
    assert serve_port(rayservice)
    (keep,) = endpoint["relabelings"]
    assert keep == {
        "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_node_type"],
        "regex": "head",
        "action": "keep",
    }
    assert not rayservice["spec"].get("excludeHeadPodFromServeSvc")  # the head stays in the Service


def test_pod_monitor_scrapes_every_ray_pod(
    monitoring: list[dict[str, Any]], rayservice: dict[str, Any]
) -> None:
    spec = find(monitoring, "PodMonitor")["spec"]
    ours = {k: v for k, v in spec["selector"]["matchLabels"].items() if not k.startswith("ray.io/")}
    assert ours
    (endpoint,) = spec["podMetricsEndpoints"]
    for group, template in pod_templates(rayservice).items():
        assert ours.items() <= template["metadata"]["labels"].items(), group
        ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
        assert endpoint["port"] in ports, group


# --------------------------------------------------------------------------------- collector


def test_collector_takes_metrics(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, rayservice: dict[str, Any]
) -> None:
    docs = rendered[overlay]
    config = yaml.safe_load(find(docs, "ConfigMap", "specserve-otel-collector")["data"]["collector.yaml"])
    pipeline = config["service"]["pipelines"]["metrics"]
    assert set(pipeline["receivers"]) == {"otlp", "prometheus/specserve"}
    for part in ("receivers", "processors", "exporters"):
        assert all(name in config[part] for name in pipeline[part]), part
    (job,) = config["receivers"]["prometheus/specserve"]["config"]["scrape_configs"]
    (targets,) = job["static_configs"]
    service = f"{rayservice['metadata']['name']}-serve-svc:{serve_port(rayservice)}"
    assert targets["targets"] == [service] and job["metrics_path"] == "/metrics"
    assert config["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]  # traces as they were

    (remote_write,) = [e for e in pipeline["exporters"] if e.startswith("prometheusremotewrite")]
    variable = re.fullmatch(r"\$\{env:(\w+)\}", config["exporters"][remote_write]["endpoint"])
    assert variable
    collector = find(docs, "Deployment", "specserve-otel-collector")["spec"]["template"]["spec"]
    (container,) = collector["containers"]
    source = {e["name"]: e for e in container["env"]}[variable.group(1)]["valueFrom"]["configMapKeyRef"]
    assert find(docs, "ConfigMap", source["name"])["data"][source["key"]].startswith("http")
    # the Service exposes exactly the container's receiving ports (remote write only sends)
    service = find(docs, "Service", "specserve-otel-collector")["spec"]
    assert {p["targetPort"] for p in service["ports"]} == {p["name"] for p in container["ports"]} - {"health"}
