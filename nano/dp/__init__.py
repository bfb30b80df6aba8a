"""Data-parallel replicas behind a KV-aware router, an add-on on the engine's public seams
(add_request's checks: LLMEngine.make_sequence; the prefix cache's changes:
BlockManager.cache_events) and the disaggregated add-on's ranks (nano/disagg/ranks.py: the
router's base, the loop and the launch; links.py):

  serving.py  the replicas (each a whole LLMEngine) and the router on rank 0
  policy.py   round-robin, least-loaded, kv-aware; the router's index of each replica's blocks
  metrics.py  the run's total and per-replica figures; Prometheus series labelled by engine
  cli.py      run.py's --dp, --bench --dp-compare
"""
