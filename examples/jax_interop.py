"""A torch model trained as a JAX function, exported, and served by a process
that imports JAX alone.

    python examples/jax_interop.py
"""
import pathlib
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import torch

import torchtpu
from torchtpu.jax import functionalize

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
params, fn = functionalize(model)

# y = sin(x0) + x1^2, learnt by SGD written in JAX over the model's lowerings.
x = jax.random.uniform(jax.random.key(0), (256, 2), jnp.float32, -1.0, 1.0)
y = (jnp.sin(x[:, 0]) + x[:, 1] ** 2)[:, None]


@jax.jit
def step(params, x, y):
    def loss(p):
        out, _ = fn(p, x)
        return ((out - y) ** 2).mean()
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.2 * g, params, grads), value


for i in range(300):
    params, loss = step(params, x, y)
    if i % 100 == 0 or i == 299:
        print(f"step {i}: loss {float(loss):.4f}")

# The trained weights back into the torch model, then its forward exported.
model.load_state_dict({name: torch.from_numpy(jax.device_get(a).copy()) for name, a in params.items()})
exported = torchtpu.export(model, (torch.zeros(4, 2),))
folder = pathlib.Path(tempfile.mkdtemp())
exported.save(folder)

server = f"""
import sys, jax, numpy as np
jax.config.update("jax_enable_x64", True)
program = jax.export.deserialize(open("{folder / 'program.bin'}", "rb").read())
params = dict(np.load("{folder / 'params.npz'}"))
x = np.array([[0.5, -0.5], [0.0, 1.0], [1.0, 0.0], [-1.0, -1.0]], np.float32)
print("served:", np.asarray(program.call(params, x))[:, 0].round(3))
print("expected:", (np.sin(x[:, 0]) + x[:, 1] ** 2).round(3))
assert "torch" not in sys.modules
"""
subprocess.run([sys.executable, "-c", server], check=True, timeout=120)
