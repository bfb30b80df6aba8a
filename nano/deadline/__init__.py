"""Deadline-aware scheduling, an add-on on the scheduler's policy seam (nano/policy.py: FCFS's
methods are the interface, a policy class is passed to LLMEngine(config, policy=...)):

  policy.py   Deadline: earliest deadline first, admission control, steps cut short where that
              buys a target, late sequences preempted first (docs/deadline-policy.md)
  cli.py      run.py's --policy and --drop-late, as the policy class the engine takes
"""
