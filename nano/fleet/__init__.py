"""Engines side by side under one MPI launch, behind a router on rank 0: what disaggregated
serving (nano/disagg) and data-parallel replicas (nano/dp) both build on.

  ranks.py  the instance and the router's base (routing only where a request could ever fit:
            the fleet's capacity check), the loop every rank runs, the launch
  world.py  every rank of the run, split into replicas of --tp ranks (the core knows only its
            own TP group)
  worker.py a TP rank > 0 replaying its rank 0's steps, under any launch (run.py's too)
  links.py  how instances talk: MPI point-to-point, or in-process queues (tests)
  cli.py    the command line's side of such a run: requests, progress, --output, the report
"""
