"""What the engine measures, an observer attached to it (metrics.py: Metrics.attach, metrics_of),
exported: JSONL snapshots (export.py), Prometheus under vLLM's names (prometheus.py), and the
run's summary (summary.py); and the stall watch: a step's CPU time in one process
(watchdog.py), every rank's heartbeat under MPI (heartbeat.py), and Open MPI's launcher as a
rank sees it (launcher.py: its stderr, its end after an abort)."""
