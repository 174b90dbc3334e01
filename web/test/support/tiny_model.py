"""Build the test suite's tiny random model (a 2-layer Llama, byte-level tokenizer) at argv[1]."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.conftest import build_tiny_model

build_tiny_model(Path(sys.argv[1]))
