"""Watching a run: its events (metrics.jsonl, TensorBoard), Prometheus metrics, the status page.

The coordinator is the one place that sees every merge, push, pull, heartbeat and evaluation, so
it records them (events.py), serves them to Prometheus (prometheus.py) and to a browser
(http.py, page.html). Nothing here decides anything: take it away and the run trains the same.
"""
