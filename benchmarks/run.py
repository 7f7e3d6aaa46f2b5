"""torchtpu benchmarks (`make bench`): the runner.

Each benchmark is a function in its own module returning a list of rows
(dicts), with the table's title and columns attached to it; main() runs the
ones asked for, prints their tables and writes them into docs/performance.md
between the markers named after the benchmark. Add a benchmark by writing a
module and listing its function in BENCHMARKS. Benchmark modules import only
common.py (and fused.py's models), never this runner.

    python benchmarks/run.py                 # all
    python benchmarks/run.py per_op          # some
    python benchmarks/run.py --no-write      # print only
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import torchtpu  # noqa: E402
from amp import amp_training_steps  # noqa: E402
from buckets import buckets  # noqa: E402
from cache_warm_start import cache_warm_start  # noqa: E402
from checkpoint_memory import checkpoint_memory  # noqa: E402
from compiled import compiled_steps  # noqa: E402
from compiled_hf import compiled_hf_step  # noqa: E402
from distributed import all_reduce_bandwidth, ddp_step  # noqa: E402
from common import table  # noqa: E402
from fused import replay_steps, training_steps  # noqa: E402
from generate import generate  # noqa: E402
from generate_floor import generate_floor  # noqa: E402
from index_check import index_check  # noqa: E402
from loader import loader  # noqa: E402
from optim import fused_adamw  # noqa: E402
from per_op import host_cost, per_op  # noqa: E402
from recompiles import graph_growth, recompiles  # noqa: E402
from soak import soak  # noqa: E402
from transfers import transfers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "performance.md")


BENCHMARKS = {"per_op": per_op, "host_cost": host_cost,
              "training_steps": training_steps, "replay_steps": replay_steps,
              "amp_training_steps": amp_training_steps,
              "compiled_steps": compiled_steps, "compiled_hf_step": compiled_hf_step,
              "cache_warm_start": cache_warm_start, "transfers": transfers, "loader": loader,
              "buckets": buckets,
              "index_check": index_check, "fused_adamw": fused_adamw, "generate": generate,
              "generate_floor": generate_floor, "recompiles": recompiles,
              "graph_growth": graph_growth, "checkpoint_memory": checkpoint_memory,
              "all_reduce_bandwidth": all_reduce_bandwidth, "ddp_step": ddp_step, "soak": soak}


# ---- output -------------------------------------------------------------------

def write_section(name, text):
    """Replace the text between <!-- bench:name --> and <!-- /bench:name --> in the doc."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    doc = open(DOC).read() if os.path.exists(DOC) else "# Performance\n"
    block = f"{start}\n{text}\n{end}"
    if start in doc and end in doc:
        doc = doc[:doc.index(start)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    with open(DOC, "w") as f:
        f.write(doc)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (of {', '.join(BENCHMARKS)})")
    parser.add_argument("--no-write", action="store_true", help=f"do not update {DOC}")
    args = parser.parse_args(argv)
    names = args.names or list(BENCHMARKS)
    for name in names:
        bench = BENCHMARKS[name]
        rows = bench()
        text = table(bench, rows)
        load = os.getloadavg()[0]
        stamp = (f"_Measured {time.strftime('%Y-%m-%d')} by `make bench` on JAX "
                 f"{torchtpu.runtime.PLATFORM} ({os.cpu_count()} host cores, load average "
                 f"{load:.1f} at the end), torch {torch.__version__}._")
        print(f"\n{bench.title}\n\n{text}\n")
        if not args.no_write:
            write_section(name, f"{stamp}\n\n{text}")


if __name__ == "__main__":
    main()
