"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), an add-on on the engine's public API
(add_request, step, abort, finish, snapshot):

  app.py            endpoints, request models, errors, streaming (the event loop's side)
  engine_thread.py  the thread that owns the engine: jobs in, steps, text and logprobs out
  limits.py         what one request may ask for (the --serve flags' defaults)
  cli.py            run.py --serve
"""
