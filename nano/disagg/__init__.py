"""Disaggregated prefill and decode, an add-on on the engine's public seams (a sequence held
out of the batch with its blocks: Scheduler.hold / reserve / resume; its blocks read out and
written in: ModelRunner.read_blocks / write_blocks) and on nano/fleet (engines side by side
on ranks: the router's base, the loop every rank runs, the launch, the links):

  serving.py      the router and the prefill and decode instances, each a whole LLMEngine
  kv_transfer.py  a sequence's blocks as a checksummed payload, in pieces
  metrics.py      the run's figures: handoffs, each pool's signals, how much prefill slows decodes
  compare.py      colocated vs disaggregated on the same cores and arrivals
  estimate.py     the P:D split a workload needs, from the step-time model
  cli.py          run.py's --disagg, --bench --disagg-compare and --capacity --disagg: their flags
                  and checks
"""
