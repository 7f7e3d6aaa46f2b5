"""The accuracy of float32 (and bfloat16) math on the device torchtpu runs on,
against float64 on the host: for each family of transcendental ops, the
largest error relative to the exact value (and in units of the last place),
beside CPU's own for the same inputs. On a TPU this is the table
docs/tpu.md gives and the tests' tolerances there use.

    python3 scripts/tpu_accuracy.py [--json FILE]
"""
import argparse
import json

import torch

import torchtpu  # noqa: F401  (the tpu device)

# (name, function, inputs): inputs span where each function is used.
_G = torch.Generator().manual_seed(0)


def _span(low, high, n=4096):
    return torch.linspace(low, high, n, dtype=torch.float64)


def _normal(scale, n=4096):
    return torch.randn(n, generator=_G, dtype=torch.float64) * scale


FAMILIES = [
    ("exp", torch.exp, lambda: _span(-80, 80)),
    ("expm1", torch.expm1, lambda: _span(-5, 5)),
    ("log", torch.log, lambda: torch.logspace(-30, 30, 4096, dtype=torch.float64)),
    ("log1p", torch.log1p, lambda: _span(-0.99, 10)),
    ("log2", torch.log2, lambda: torch.logspace(-30, 30, 4096, dtype=torch.float64)),
    ("pow", lambda x: torch.pow(x.abs() + 0.1, 2.7), lambda: _normal(10)),
    ("sqrt", torch.sqrt, lambda: torch.logspace(-30, 30, 4096, dtype=torch.float64)),
    ("rsqrt", torch.rsqrt, lambda: torch.logspace(-30, 30, 4096, dtype=torch.float64)),
    ("tanh", torch.tanh, lambda: _span(-10, 10)),
    ("sigmoid", torch.sigmoid, lambda: _span(-30, 30)),
    ("sin", torch.sin, lambda: _span(-100, 100)),
    ("cos", torch.cos, lambda: _span(-100, 100)),
    ("tan", torch.tan, lambda: _span(-1.5, 1.5)),
    ("atan", torch.atan, lambda: _normal(10)),
    ("asin", torch.asin, lambda: _span(-0.999, 0.999)),
    ("erf", torch.erf, lambda: _span(-5, 5)),
    ("erfinv", torch.erfinv, lambda: _span(-0.999, 0.999)),
    ("lgamma", torch.lgamma, lambda: _span(0.01, 50)),
    ("digamma", torch.digamma, lambda: _span(0.01, 50)),
    ("gelu", torch.nn.functional.gelu, lambda: _span(-10, 10)),
    ("gelu_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh"), lambda: _span(-10, 10)),
    ("silu", torch.nn.functional.silu, lambda: _span(-20, 20)),
    ("softplus", torch.nn.functional.softplus, lambda: _span(-20, 20)),
    ("softmax", lambda x: torch.softmax(x.reshape(64, 64), -1), lambda: _normal(5)),
    ("log_softmax", lambda x: torch.log_softmax(x.reshape(64, 64), -1), lambda: _normal(5)),
    ("logsumexp", lambda x: torch.logsumexp(x.reshape(64, 64), -1), lambda: _normal(5)),
    ("logcumsumexp", lambda x: torch.logcumsumexp(x.reshape(64, 64), -1), lambda: _normal(5)),
    ("cross_entropy", lambda x: torch.nn.functional.cross_entropy(
        x.reshape(64, 64), torch.arange(64, device=x.device), reduction="none"), lambda: _normal(5)),
    ("binary_cross_entropy", lambda x: torch.nn.functional.binary_cross_entropy(
        torch.sigmoid(x), torch.sigmoid(x.flip(0)), reduction="none"), lambda: _normal(3)),
    ("layer_norm", lambda x: torch.nn.functional.layer_norm(x.reshape(64, 64), (64,)), lambda: _normal(3)),
    ("matmul", lambda x: x.reshape(64, 64) @ x.reshape(64, 64).T, lambda: _normal(1)),
]


def _errors(got, exact):
    """(the largest error relative to |exact| + 1e-5, as the tests judge a
    value: atol 1e-5 plus rtol times it; the largest error in float32 ulps
    where |exact| >= 1e-3, away from a function's zeros)."""
    got = got.double().cpu()
    finite = exact.isfinite()
    err, ref = (got - exact).abs()[finite], exact.abs()[finite]
    rel = (err / (ref + 1e-5)).max().item() if err.numel() else 0.0
    big = ref >= 1e-3
    # float32's ulp at each exact value: 2^-23 of its power of two.
    ulp = torch.ldexp(torch.ones_like(ref[big]), torch.frexp(ref[big])[1] - 24)
    return rel, (err[big] / ulp).max().item() if big.any() else 0.0


def measure(dtype=torch.float32):
    rows = []
    for name, fn, inputs in FAMILIES:
        x = inputs().to(dtype)
        exact = fn(x.double())
        rel_d, ulp_d = _errors(fn(x.to("tpu")), exact)
        rel_c, ulp_c = _errors(fn(x), exact)
        rows.append({"op": name, "dtype": str(dtype).replace("torch.", ""), "device_rel": rel_d,
                     "device_ulp": ulp_d, "cpu_rel": rel_c, "cpu_ulp": ulp_c})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    import jax
    rows = measure()
    kind = jax.devices()[0].device_kind
    print(f"float32 accuracy on {kind} (JAX {jax.__version__}) against float64, beside CPU's\n")
    print("| op | device: max error / (|exact| + 1e-5) | ulps (|exact| >= 1e-3) | CPU: the same | ulps |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['device_rel']:.2e} | {r['device_ulp']:.1f} | {r['cpu_rel']:.2e} | {r['cpu_ulp']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device_kind": kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
