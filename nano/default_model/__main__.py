"""python -m nano.default_model: fetch and convert the default model into weights/."""
import sys

from nano import weights
from nano.default_model import ensure
from nano.errors import NanoError

try:
    ensure()
except NanoError as e:
    sys.exit(f"error: {e}")
print(weights.WEIGHTS_DIR / weights.DEFAULT_MODEL)
