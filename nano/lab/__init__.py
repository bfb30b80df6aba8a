"""The lab: each serving concept's claim measured on this engine, one experiment per module in
nano/lab/experiments/, run by `python run.py --lab NAME` (a table, a PNG and a JSON).

An add-on: it drives the engine only through its public API (LLMEngine add_request / step,
EngineConfig, SamplingParams, engine.metrics) and the other add-ons' public functions; the
core never imports it."""
