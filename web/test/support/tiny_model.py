"""Build one of the test suite's tiny random models at argv[1].

With no argv[2]: the 2-layer Llama with a byte-level tokenizer (tests/conftest.py);
argv[2] names another kind of tests/model_kinds.py (`esm_mlm`: an ESM-2 masked LM).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

if len(sys.argv) > 2:
    from tests.model_kinds import build

    build(sys.argv[2], Path(sys.argv[1]))
else:
    from tests.conftest import build_tiny_model

    build_tiny_model(Path(sys.argv[1]))
