"""python -m nano.default_model [NAME]: fetch and convert a model nano knows by name (the
default one without NAME) into weights/, and print its folder."""
import sys

from nano import weights
from nano.default_model import MODELS, ensure
from nano.errors import NanoError

name = sys.argv[1] if len(sys.argv) > 1 else weights.DEFAULT_MODEL
if len(sys.argv) > 2 or name not in MODELS:
    print(f"error: usage: python -m nano.default_model [NAME], NAME one of {', '.join(MODELS)}", file=sys.stderr)
    sys.exit(2)
try:
    ensure(name)
except NanoError as e:
    sys.exit(f"error: {e}")
print(weights.WEIGHTS_DIR / name)
