"""The lab: each serving concept's claim measured on this engine, one experiment per module in
nano/lab/experiments/, run by `python run.py --lab NAME` (a table, a PNG and a JSON).

An add-on and a driver, as run.py is: it drives the engine only through its public API
(LLMEngine add_request / step, EngineConfig, SamplingParams, its Metrics) and the other
add-ons' public functions, since its experiments compare their modes; the core and the
other add-ons never import it."""
