"""Model kinds: what a served model is, what it can do, and how each kind is loaded.

- `base.py`: `Model`, as tools see it; `Capability` and `Kind`;
- `detect.py`: a checkpoint's kind, from what its config says;
- `causal_lm.py`, `masked_lm.py`, `encoder.py`: the Hugging Face kinds;
- `custom.py`: a user's own model through `--model-loader`, and the protocol it implements;
- `probes.py`: each capability proven on the loaded weights;
- `capabilities.py`: the one check of a tool against a model.
"""

from gateway.models.base import Capability, Kind, Model

__all__ = ["Capability", "Kind", "Model"]
