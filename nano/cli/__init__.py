"""The command line's modes (run.py dispatches to them) and what they share: prompt files in,
completions, progress and the run's summary out. Each add-on's own modes live with it
(nano/bench, nano/disagg, nano/server)."""
