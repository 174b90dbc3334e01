"""Write a tiny SAE for the tiny model: argv[1] the model's folder, argv[2] the SAE's folder.

16 ReLU features on the residual stream after decoder block 0, as tests/test_sae.py
makes them: unit decoder rows, the encoder their transpose (times 2), a few labels.
Prints the path of the safetensors file (its sidecar, res0.json, is next to it).
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

N = 16
model, folder = Path(sys.argv[1]), Path(sys.argv[2])
d = json.loads((model / "config.json").read_text())["hidden_size"]
g = torch.Generator().manual_seed(0)
w_dec = torch.randn(N, d, generator=g)
w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
tensors = {
    "W_enc": w_dec.T.clone() * 2,
    "b_enc": torch.randn(N, generator=g) * 0.1,
    "W_dec": w_dec,
    "b_dec": torch.randn(d, generator=g) * 0.01,
}
folder.mkdir(parents=True, exist_ok=True)
path = folder / "res0.safetensors"
save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
sidecar = {"layer": 0, "activation": "relu", "name": "res0", "labels": {"0": "dogs", "1": "Hot dogs", "2": "cats"}}
(folder / "res0.json").write_text(json.dumps(sidecar))
print(path)
