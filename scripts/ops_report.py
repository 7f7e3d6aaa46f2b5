#!/usr/bin/env python
"""Survey torchtpu's op coverage against PyTorch's OpInfo database.

For each OpInfo (filter with --ops / --family) and dtype, run a few sample
inputs on CPU and on tpu and compare them (the same check as
tests/test_opinfo.py, from tests/opinfo_common.py). Each (op, dtype, kind)
is pass, fallback (passes, but some aten op ran on the CPU fallback), fail
(with the first line of the error) or skip.

  .venv/bin/python scripts/ops_report.py --ops add,mul --dtypes float32,int64 --grad
  .venv/bin/python scripts/ops_report.py --family linalg --fails-only
  .venv/bin/python scripts/ops_report.py --all --jobs 2 --json /tmp/ops.json \\
      --markdown docs/ops.md --write-expected tests/opinfo_expected.py
  .venv/bin/python scripts/ops_report.py --from-json /tmp/ops.json --markdown docs/ops.md
  .venv/bin/python scripts/ops_report.py --ops cumsum --all --merge /tmp/ops.json \
      --json /tmp/ops.json --write-expected tests/opinfo_expected.py
"""
import argparse
import collections
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from shards import run_shards  # noqa: E402 (beside this script)

ALL_DTYPES = "float32,int64,bool,bfloat16"


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated op ids or names (e.g. add,div.trunc_rounding)")
    p.add_argument("--family", help="substring of the op id (e.g. linalg, nn.functional, special)")
    p.add_argument("--dtypes", default="float32", help=f"comma-separated (default float32; all: {ALL_DTYPES})")
    p.add_argument("--samples", type=int, default=2, help="sample inputs per op (default 2)")
    p.add_argument("--grad", action="store_true", help="also compare float32 gradients")
    p.add_argument("--all", action="store_true", help=f"--dtypes {ALL_DTYPES} --grad")
    p.add_argument("--no-extras", action="store_true",
                   help="skip the non-contiguous, in-place and out= checks (run for float32 only)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per (op, dtype, kind)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (a worker that crashes restarts after the op it was on)")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # i/n, used by --jobs
    p.add_argument("--jsonl", help=argparse.SUPPRESS)  # a shard's results, used by --jobs
    p.add_argument("--json", help="write results as JSON")
    p.add_argument("--from-json", help="report on results from an earlier --json instead of running")
    p.add_argument("--merge", help="results of an earlier --json to update with this run's "
                   "(re-check a few ops, then regenerate the full report and expected list)")
    p.add_argument("--recheck", help="with --merge: re-run only the merged entries with these "
                   "statuses (e.g. fail,fallback), plus any --ops")
    p.add_argument("--markdown", help="write the coverage report as markdown (docs/ops.md)")
    p.add_argument("--write-expected", help="write the expected-failure file (tests/opinfo_expected.py)")
    p.add_argument("--fails-only", action="store_true", help="print only failing/fallback rows")
    p.add_argument("--quiet", action="store_true", help="no per-op table")
    args = p.parse_args()
    if args.all:
        args.dtypes, args.grad = ALL_DTYPES, True
    return args


def jobs_of(args):
    from opinfo_common import DTYPES, op_id, select_ops
    ops = select_ops(args.ops.split(",") if args.ops and not args.recheck else None, args.family)
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    jobs = [(op, dt, "forward") for op in ops for dt in dtypes]
    if args.grad:
        jobs += [(op, DTYPES["float32"], "backward") for op in ops]
    if args.recheck and args.merge:
        from opinfo_common import OPS
        with open(args.merge) as f:
            base = json.load(f)["results"]
        want = set(args.recheck.split(","))
        keys = {(d["op"], d["dtype"], d["kind"]) for d in base if d["status"] in want}
        named = set(args.ops.split(",")) if args.ops else set()
        jobs = [j for j in jobs if j[0].name in named or op_id(j[0]) in named]
        jobs += [(OPS[o], DTYPES[dt], kind) for o, dt, kind in sorted(keys)
                 if o not in named and OPS[o].name not in named]
    # Group by op so the shards balance the expensive families.
    jobs.sort(key=lambda j: (j[0].name, j[1] != DTYPES["float32"], j[2]))
    return jobs


def run_local(args, jsonl=None):
    """Run the checks in this process; with jsonl, append each result to it as
    it is made and skip the jobs already there (a shard resumes after a crash)."""
    from opinfo_common import check, op_id
    jobs = jobs_of(args)
    if args.shard:
        i, n = map(int, args.shard.split("/"))
        jobs = jobs[i::n]
    done = {}
    if jsonl and os.path.exists(jsonl):
        with open(jsonl) as f:
            for line in f:
                d = json.loads(line)
                done[(d["op"], d["dtype"], d["kind"])] = d
    results = []
    for k, (op, dt, kind) in enumerate(jobs):
        key = (op_id(op), str(dt).replace("torch.", ""), kind)
        if key in done:
            results.append(done[key])
            continue
        if jsonl:  # mark it started: if the process dies here, it is a failure
            with open(jsonl + ".current", "w") as f:
                json.dump(key, f)
        t0 = time.time()
        r = check(op, dt, kind, samples=args.samples, extras=False if args.no_extras else None,
                  timeout=args.timeout)
        d = r.as_dict()
        d["seconds"] = round(time.time() - t0, 2)
        results.append(d)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps(d) + "\n")
        if not args.quiet and not args.shard:
            print_row(d, args)
        elif args.shard:
            print(f"[{args.shard}] {k + 1}/{len(jobs)} {key[0]} {key[1]} {kind}: {r.status}",
                  file=sys.stderr, flush=True)
    return results


def run_parallel(args):
    """Shard the jobs over worker processes (shards.run_shards)."""
    def crashed(job, rc):
        op, dtype, kind = job
        return dict(op=op, dtype=dtype, kind=kind, status="fail",
                    error=f"process crashed (exit code {rc})", fallbacks=[], samples=0)
    results = run_shards(__file__, sys.argv[1:], args.jobs,
                         ("--json", "--markdown", "--write-expected", "--jobs", "--from-json"),
                         crashed, "ops_report_")
    results.sort(key=lambda d: (d["op"], d["dtype"] != "float32", d["dtype"], d["kind"]))
    if not args.quiet:
        for d in results:
            print_row(d, args)
    return results


def print_row(d, args):
    if args.fails_only and d["status"] in ("pass", "skip"):
        return
    extra = d["error"] if d["status"] in ("fail", "skip") else ",".join(d["fallbacks"])
    print(f"{d['op']:<48} {d['dtype']:<9} {d['kind']:<8} {d['status']:<8} {extra}", flush=True)


def summarize(results):
    """(dtype, kind) -> counts and rates over the entries that ran."""
    table = {}
    groups = collections.defaultdict(collections.Counter)
    for d in results:
        groups[(d["dtype"], d["kind"])][d["status"]] += 1
    for key, c in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != "float32", kv[0][0])):
        total = c["pass"] + c["fallback"] + c["fail"]
        table[key] = dict(
            total=total, passed=c["pass"], fallback=c["fallback"], failed=c["fail"],
            skipped=c["skip"],
            rate=c["pass"] / total if total else 0.0,
            rate_with_fallback=(c["pass"] + c["fallback"]) / total if total else 0.0)
    return table


def print_summary(table):
    print()
    print(f"{'dtype':<9} {'kind':<8} {'entries':>7} {'pass':>5} {'fallbk':>6} {'fail':>5} "
          f"{'skip':>5} {'pass%':>7} {'w/ fallback%':>12}")
    for (dtype, kind), s in table.items():
        print(f"{dtype:<9} {kind:<8} {s['total']:>7} {s['passed']:>5} {s['fallback']:>6} "
              f"{s['failed']:>5} {s['skipped']:>5} {100 * s['rate']:>6.1f}% "
              f"{100 * s['rate_with_fallback']:>11.1f}%")


def markdown(results, table, meta):
    lines = [
        "# Op coverage against PyTorch's OpInfo database",
        "",
        "Generated by `scripts/ops_report.py --markdown docs/ops.md` from a full run "
        "(do not edit by hand). Each OpInfo entry of "
        "`torch.testing._internal.common_methods_invocations.op_db` "
        f"(torch {meta['torch']}) runs up to {meta['samples']} sample inputs on CPU and on "
        "`tpu`; results are compared with `torch.testing.assert_close` (dtype checked). "
        "Forward also runs each sample with non-contiguous inputs and the in-place "
        "variant through a view; backward compares `torch.autograd.grad` results. "
        "Random ops are checked for shape, dtype, range and reproducibility under "
        "`torch.manual_seed`. The same checks run in `tests/test_opinfo.py`.",
        "",
        "- **pass**: matches CPU, nothing ran on the CPU fallback.",
        "- **fallback**: matches CPU, but some aten op ran on the CPU fallback.",
        "- **fail**: raised on `tpu` or differed from CPU.",
        "- entries whose dtype CPU does not support, or whose samples all raise on "
        "CPU, are not counted.",
        "",
        "## Pass rates",
        "",
        "| dtype | kind | entries | pass | fallback | fail | pass rate | pass rate counting fallback |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (dtype, kind), s in table.items():
        lines.append(f"| {dtype} | {kind} | {s['total']} | {s['passed']} | {s['fallback']} | "
                     f"{s['failed']} | {100 * s['rate']:.1f}% | {100 * s['rate_with_fallback']:.1f}% |")
    # CPU fallbacks: aten op -> OpInfo entries that reached it.
    by_aten = collections.defaultdict(set)
    for d in results:
        for f in d["fallbacks"]:
            by_aten[f].add(d["op"])
    lines += ["", "## Ops that run on the CPU fallback", "",
              "Aten ops that ran on the CPU fallback during the run (whether the entry "
              "passed or failed), with the OpInfo entries that reached them.", ""]
    if by_aten:
        lines += ["| aten op | OpInfo entries |", "|---|---|"]
        for aten_op in sorted(by_aten):
            ents = sorted(by_aten[aten_op])
            shown = ", ".join(f"`{e}`" for e in ents[:12]) + (f" (+{len(ents) - 12})" if len(ents) > 12 else "")
            lines.append(f"| `{aten_op}` | {shown} |")
    else:
        lines.append("None.")
    fails = [d for d in results if d["status"] == "fail"]
    lines += ["", "## Failing entries", "",
              f"{len(fails)} (op, dtype, kind) entries fail; each is listed in "
              "`tests/opinfo_expected.py`.", ""]
    if fails:
        lines += ["| op | dtype | kind | error |", "|---|---|---|---|"]
        for d in sorted(fails, key=lambda d: (d["op"], d["kind"], d["dtype"])):
            err = d["error"].replace("|", "/").replace("`", "'")
            lines.append(f"| `{d['op']}` | {d['dtype']} | {d['kind']} | {err} |")
    lines.append("")
    return "\n".join(lines)


def reason_of(d):
    """The expected-failure reason: a category, then the error."""
    err = re.sub(r" at 0x[0-9a-f]+", "", d["error"])
    if "process crashed" in err or "returned NULL without setting an exception" in err:
        # The latter is the same failure (an error on an autograd worker
        # thread) when it does not abort the process.
        cat = "crashes the process"
    elif "timed out" in err:
        cat = "too slow"
    elif err.startswith("NotImplementedError"):
        cat = "not implemented on tpu"
    elif "dtype" in err and "AssertionError" in err:
        cat = "result dtype differs from CPU"
    elif "not close" in err or "not equal" in err or "Mismatch" in err:
        cat = "values differ from CPU"
    elif "AssertionError" in err:
        cat = "result differs from CPU"
    else:
        cat = "raises on tpu"
    return f"{cat}: {err}"


def write_expected(results, path):
    fails = sorted((d for d in results if d["status"] == "fail"),
                   key=lambda d: (d["op"], d["dtype"], d["kind"]))
    falls = sorted((d for d in results if d["status"] == "fallback"),
                   key=lambda d: (d["op"], d["dtype"], d["kind"]))
    out = [
        '"""Expected results of tests/test_opinfo.py that are not a clean pass.',
        "",
        "Generated by scripts/ops_report.py --write-expected from a full run; an",
        "entry may be edited by hand to give a better reason. Strict: an entry",
        "that starts passing fails the test, so both lists only shrink.",
        "",
        "EXPECTED_FAILURES: (op id, dtype, kind) -> why it fails (the error).",
        "EXPECTED_FALLBACKS: (op id, dtype, kind) -> the aten ops that run on the",
        "CPU fallback (values match CPU).",
        '"""',
        "",
        "EXPECTED_FAILURES = {",
    ]
    for d in fails:
        out.append(f"    {(d['op'], d['dtype'], d['kind'])!r}:\n        {reason_of(d)!r},")
    out += ["}", "", "EXPECTED_FALLBACKS = {"]
    for d in falls:
        out.append(f"    {(d['op'], d['dtype'], d['kind'])!r}: {', '.join(d['fallbacks'])!r},")
    out += ["}", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    args = parse()
    t0 = time.time()
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        results, meta = data["results"], data["meta"]
    else:
        if not args.shard:  # workers in subprocesses survive a crashing op
            results = run_parallel(args)
        else:
            results = run_local(args, args.jsonl)
        import torch
        meta = dict(torch=torch.__version__, samples=args.samples, dtypes=args.dtypes,
                    grad=args.grad, seconds=round(time.time() - t0, 1))
    if args.merge and not args.shard:
        with open(args.merge) as f:
            base = json.load(f)
        fresh = {(d["op"], d["dtype"], d["kind"]): d for d in results}
        results = [fresh.pop((d["op"], d["dtype"], d["kind"]), d) for d in base["results"]]
        results += list(fresh.values())
        meta = dict(base["meta"], merged=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    if args.shard:
        return
    table = summarize(results)
    print_summary(table)
    print(f"\n{len(results)} checks in {time.time() - t0:.0f}s")
    if args.markdown:
        from modules_report import modules_section  # its section of the file stays
        keep = modules_section(args.markdown)
        with open(args.markdown, "w") as f:
            f.write(markdown(results, table, meta) + ("\n" + keep if keep else ""))
    if args.write_expected:
        write_expected(results, args.write_expected)


if __name__ == "__main__":
    main()
