"""The command line's shared pieces, which run.py assembles: the parser and the flags every
mode shares (flags.py: prompts, sampling, the engine's EngineConfig fields, metrics files),
prompt files in (prompts.py), completions, progress, the run's summary and the one-line error
exit out (output.py), the offline run and the warm-up (offline.py). Each add-on's own modes,
flags and checks live with it (nano/bench, nano/disagg, nano/dp, nano/server, nano/lab)."""
