"""Locust load tests of specserve: workloads, the policy x load matrix runner, the cost report.

- ``workloads.py`` + ``prompts/``: what simulated users ask (chat, code, JSON, creative, bulk).
- ``locustfile.py``: the Locust user classes (streamed chat completions, measured).
- ``streaming.py``: one streamed request, measured (TTFT, TPOT, tokens, speculation block).
- ``run_matrix.py``: ``specserve loadtest``; ``server.py`` (one cell's ``specserve serve``),
  ``cluster.py`` (the local Ray cluster, server counters, replica-seconds), ``progress.py``.
- ``analysis.py``: per-cell figures and cost; ``report.py``: report.md and plots.

Importing this package starts nothing and imports neither Ray nor Locust.
"""
