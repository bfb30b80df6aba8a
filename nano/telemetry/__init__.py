"""The engine's metrics exported: JSONL snapshots (export.py), Prometheus under vLLM's names
(prometheus.py), and the run's summary (summary.py)."""
