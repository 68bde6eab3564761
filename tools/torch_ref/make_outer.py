"""Reference trajectories of the outer optimizer (optim/outer.h, issue 40).

Rerun (deterministic; rewrites tests/golden/outer_ref.safetensors):

    /usr/bin/python3 tools/torch_ref/make_outer.py

The global copy theta starts at theta0; at each of 3 outer steps the mean
pseudo-gradient delta_t (given) is set as theta's .grad and PyTorch's own
optimizer steps, as DiLoCo's reference code (and torchft's local_sgd.DiLoCo)
do: torch.optim.SGD (lr, momentum 0 and 0.9, nesterov) and torch.optim.Adam
(lr, betas=(momentum, beta2), eps). theta after every step is stored.
"""
import os

import numpy as np
import torch

from st_writer import save

N, STEPS = 1000, 3
g = np.random.default_rng(40)
theta0 = g.standard_normal(N).astype(np.float32)
deltas = (g.standard_normal((STEPS, N)) * 0.01).astype(np.float32)
out = {"theta0": theta0, "deltas": deltas}

CASES = {
    "sgd": lambda p: torch.optim.SGD([p], lr=1.0, momentum=0.0),
    "sgd_m": lambda p: torch.optim.SGD([p], lr=0.5, momentum=0.9),
    "nesterov": lambda p: torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8),
}
torch.set_num_threads(1)
for name, make in CASES.items():
    p = torch.nn.Parameter(torch.from_numpy(theta0.copy()))
    opt = make(p)
    traj = []
    for t in range(STEPS):
        p.grad = torch.from_numpy(deltas[t].copy())
        opt.step()
        traj.append(p.detach().numpy().copy())
    out[name] = np.stack(traj)

here = os.path.dirname(os.path.abspath(__file__))
save(os.path.join(here, "../../tests/golden/outer_ref.safetensors"), out)
print("wrote tests/golden/outer_ref.safetensors:", ", ".join(sorted(out)))
