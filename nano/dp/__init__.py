"""Data-parallel replicas behind a KV-aware router, an add-on on the engine's public seams
(add_request's checks: LLMEngine.make_sequence; the prefix cache's changes:
BlockManager.cache_events) and on nano/fleet (engines side by side on ranks: the router's
base, the loop, the launch, the links):

  serving.py  the replicas (each a whole LLMEngine) and the router on rank 0
  policy.py   round-robin, least-loaded, kv-aware; the router's index of each replica's blocks
  metrics.py  the run's total and per-replica figures; Prometheus series labelled by engine
  front.py    --serve --dp: the router in the place of the server's engine
  cli.py      run.py's --dp, --bench --dp-compare, --serve --dp: their flags and checks
"""
