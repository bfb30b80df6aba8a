"""The engine's metrics exported (export.py): JSONL snapshots and the Prometheus text format."""
