"""Build one of the test suite's tiny random models at argv[1].

With no argv[2] (or `llama`): the 2-layer Llama with a byte-level tokenizer (tests/conftest.py);
argv[2] names another kind of tests/support/tiny_models.py (`esm_mlm`: an ESM-2 masked LM).
argv[3], when given, is the seed of its random weights (default 0): another seed, another model
of the same shape, for a gateway serving two that must answer differently.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
if kind != "llama":
    from tests.support.tiny_models import build

    build(kind, Path(sys.argv[1]), seed)
else:
    from tests.conftest import build_tiny_model

    build_tiny_model(Path(sys.argv[1]), seed=seed)
