"""Compare two runs of scripts/hf_model_tests.sh: per file and run, the
counts (passed, failed, errors, skipped) and the time; then every test that
passed in the first run and failed or erred in the second, with the first
line of its message; every test skipped in the first run (such as one that
needs an accelerator) and failing in the second; and the crashes (a file
whose pytest ended other than 0 or 1, such as a timeout's 124 or a signal,
or that left no junit XML).

    python scripts/hf_model_report.py OUTDIR [RUN_A [RUN_B]]
    python scripts/hf_model_report.py /tmp/hf_model_runs cpu-- tpu-strict

RUN is DEVICE-MODE as in the file names (NAME.RUN.xml); the defaults are
cpu-- and tpu-strict. --markdown prints the tables as Markdown.
"""

import argparse
import os
import sys
import xml.etree.ElementTree as ET


def load(path):
    """{test id: (outcome, message)} from a junit XML file, or None."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    out = {}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                msg = (child.get("message") or child.text or "").strip().splitlines()
                msg = msg[0][:200] if msg else ""
                break
            if child.tag == "skipped":
                outcome = "skipped"
        out[tid] = (outcome, msg)
    return out


def times(outdir):
    """{(name, run): (rc, seconds)} from times.txt (the last line wins)."""
    got = {}
    try:
        with open(os.path.join(outdir, "times.txt")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 5:
                    name, dev, mode, rc, secs = parts
                    got[(name, f"{dev}-{mode}")] = (int(rc), int(secs))
    except OSError:
        pass
    return got


def counts(results):
    c = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome, _ in results.values():
        c[outcome] += 1
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("run_a", nargs="?", default="cpu--")
    ap.add_argument("run_b", nargs="?", default="tpu-strict")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    tm = times(args.outdir)
    names = sorted(
        {f.split(".")[0] for f in os.listdir(args.outdir) if f.endswith((".log", ".xml"))}
        | {name for name, _ in tm}
    )
    rows, regressions, crashes, only_b = [], [], [], []
    for name in names:
        res = {}
        for run in (args.run_a, args.run_b):
            r = load(os.path.join(args.outdir, f"{name}.{run}.xml"))
            rc, secs = tm.get((name, run), (None, None))
            if r is None and rc is None:
                continue
            res[run] = r
            c = counts(r) if r is not None else None
            rows.append((name, run, c, rc, secs))
            if r is None or (rc is not None and rc > 1):
                crashes.append((name, run, rc, "no junit XML" if r is None else "pytest exit code"))
        a, b = res.get(args.run_a), res.get(args.run_b)
        if a and b:
            for tid, (outcome, _) in sorted(a.items()):
                if outcome == "passed" and tid in b and b[tid][0] in ("failed", "error"):
                    regressions.append((name, tid, b[tid][0], b[tid][1]))
                elif outcome == "passed" and tid not in b:
                    regressions.append((name, tid, "missing", f"not in the {args.run_b} run"))
                elif outcome == "skipped" and tid in b and b[tid][0] in ("failed", "error"):
                    only_b.append((name, tid, b[tid][0], b[tid][1]))

    fmt = "| {} | {} | {} | {} | {} | {} | {} | {} |" if args.markdown else "{:<10} {:<12} {:>7} {:>7} {:>7} {:>8} {:>4} {:>6}"
    print(fmt.format("file", "run", "passed", "failed", "errors", "skipped", "rc", "secs"))
    if args.markdown:
        print("|" + "---|" * 8)
    for name, run, c, rc, secs in rows:
        rc, secs = ("-" if rc is None else rc), ("-" if secs is None else secs)
        if c is None:
            print(fmt.format(name, run, "-", "-", "-", "-", rc, secs))
        else:
            print(fmt.format(name, run, c["passed"], c["failed"], c["error"], c["skipped"], rc, secs))
    print()
    print(f"passed on {args.run_a}, failed on {args.run_b}: {len(regressions)}")
    for name, tid, outcome, msg in regressions:
        print(f"- {name}: {tid} [{outcome}] {msg}")
    print()
    print(f"skipped on {args.run_a} (such as tests that need an accelerator), failed on {args.run_b}: {len(only_b)}")
    for name, tid, outcome, msg in only_b:
        print(f"- {name}: {tid} [{outcome}] {msg}")
    print()
    print(f"crashes: {len(crashes)}")
    for name, run, rc, why in crashes:
        print(f"- {name} {run}: rc {rc} ({why})")
    return 1 if regressions or crashes else 0


if __name__ == "__main__":
    sys.exit(main())
