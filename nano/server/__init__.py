"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), an add-on on the engine's public API
(add_request, step, abort, finish, snapshot):

  app.py            the endpoints, serve()
  serving.py        the requests on the event loop's side: checked, started as jobs, aborted, ended
  schemas.py        what it takes: OpenAI's request bodies, the text checks, errors in OpenAI's shape
  fields.py         the request fields nano does not implement: each a 400 naming it, unless "off"
  middleware.py     what every request passes first: body size, Host header, one log line
  completions.py    what it answers: one response or a stream, usage and logprobs in OpenAI's shapes
  engine_thread.py  the thread that owns the engine: jobs in, steps, text and logprobs out
  engine_process.py that thread in a process of its own, forked at the start, fed through a pipe
  limits.py         what one request may ask for (the --serve flags' defaults)
  cli.py            run.py --serve: its flags, their checks, the server started
"""

__version__ = "0.1.0"  # GET /version's (nano has no release yet; the first would set it here)
