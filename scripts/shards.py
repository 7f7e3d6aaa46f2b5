"""Running a report's jobs sharded over worker processes (ops_report.py,
modules_report.py): each worker re-runs the script on its shard, writing one
JSON line a job and the job it is on to `<out>.current`; a worker that
crashes (a hard abort inside a kernel) has that job recorded as failed and
is restarted, to go on past it."""
import json
import os
import subprocess
import sys
import tempfile
import time


def run_shards(script, argv, jobs, drop, crashed, prefix):
    """The results (dicts) of all shards. argv: the script's arguments, less
    the options in drop (each with its value); crashed(job, rc): the result
    of a job (the JSON list in `.current`) whose worker exited with rc."""
    argv = list(argv)
    for opt in drop:
        while opt in argv:
            i = argv.index(opt)
            del argv[i:i + 2]
    tmp = tempfile.mkdtemp(prefix=prefix)
    outs = [os.path.join(tmp, f"shard{i}.jsonl") for i in range(jobs)]

    def start(i):
        return subprocess.Popen([sys.executable, os.path.abspath(script), *argv, "--quiet",
                                 "--shard", f"{i}/{jobs}", "--jsonl", outs[i]])
    procs = {i: start(i) for i in range(jobs)}
    while procs:
        time.sleep(0.5)
        for i, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del procs[i]
            cur = outs[i] + ".current"
            if rc != 0 and os.path.exists(cur):
                with open(cur) as f:
                    d = crashed(json.load(f), rc)
                with open(outs[i], "a") as f:
                    f.write(json.dumps(d) + "\n")
                os.remove(cur)
                procs[i] = start(i)
    results = []
    for out in outs:
        if os.path.exists(out):
            with open(out) as f:
                results += [json.loads(line) for line in f]
    return results
