"""What a user waits for compilation, strict against fused, from a fresh
process with an empty compilation cache.

Workloads, each trained by hand as its model's usual script does:
- `lstm`: pytorch/examples' word language model: an nn.LSTM language model
  (2 layers, 32 wide, dropout 0.2, bptt 35, batch 20, vocab 1000), SGD by
  hand with gradient clipping, the batch sliced at a moving offset of a
  dataset kept on the device (get_batch);
- `gpt`: a 12-layer GPT-2-style model (d=64, 4 heads, seq 64, batch 4,
  vocab 512) trained with AdamW;
- `moving slice`: an embedding + linear model over a batch sliced at a
  moving offset;
- `gan`: pytorch/examples' DCGAN (64x64 images, 8 filters, batch 8, Adam),
  its step as the example writes it: the discriminator on a real and a
  fake batch, then the generator, with five reads a step;
- `lstm varying`: the LSTM over sequences of lengths 17..64 (24 steps),
  after 24 steps at length 64 in the same process (the cost is the varying
  run's alone; "fixed" rows give the 24 steps at length 64 for reference);
- `lstm uploaded varying` and `lstm uploaded fixed`: the LSTM's 24 steps
  of lengths 17..64, and of length 64, each in its own process, each
  batch made on the host and moved unmarked (`x.to(device)`, its targets
  flat; `torch.optim.SGD`'s step), as a script without a device-side
  dataset feeds it.

Columns: the first steps' wall time (10 steps; 24 for the LSTM runs of
fixed and varying length; compilation included), the steady
step (median of 15 once the background compilations are done), the seconds
the program waited for compilation and those fused mode compiled in the
background meanwhile, and the compilations (kernels + fused graphs) after
the second step (for the varying run: all of its own).

    python benchmarks/recompiles.py [--workloads lstm gpt] [--modes strict fused]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import print_rows, table, worker_rows  # noqa: E402

WORKLOADS = ("lstm", "gpt", "moving slice", "gan", "lstm varying", "lstm uploaded fixed",
             "lstm uploaded varying")
MODES = ("strict", "fused")
VARYING = [17 + (i * 47) % 48 for i in range(24)]  # 24 lengths in 17..64


def _compilations(torchtpu):
    s = torchtpu.metrics.snapshot()
    return s["compilations"] + s.get("graphs_compiled", 0)


def _lstm_model(torch, vocab=1000, width=32, layers=2):
    nn = torch.nn

    class RNNModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.2)
            self.encoder = nn.Embedding(vocab, width)
            self.rnn = nn.LSTM(width, width, layers, dropout=0.2)
            self.decoder = nn.Linear(width, vocab)

        def forward(self, x, hidden):
            out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
            return self.decoder(self.drop(out)).view(-1, vocab), hidden

    return RNNModel(), vocab, layers, width


def _lstm_steps(torch, device, lengths, batch=20, uploaded=False):
    """A step function of the word language model; each call trains on the
    next batch, of the next length in lengths (cycled), sliced from data on
    the device, or on the host and moved (uploaded)."""
    model, vocab, layers, width = _lstm_model(torch)
    model.to(device).train()
    data = torch.randint(0, vocab, (4000, batch), generator=torch.Generator().manual_seed(0))
    data = data if uploaded else data.to(device)
    # (the uploaded runs step an optimizer, as a script that moves its
    # batches usually does; the same update as the hand-written one)
    opt = torch.optim.SGD(model.parameters(), lr=20.0) if uploaded else None
    state = {"i": 0, "n": 0, "hidden": None}

    def step():
        n = lengths[state["n"] % len(lengths)]
        i = state["i"] if state["i"] + n + 1 <= data.shape[0] else 0
        x, y = data[i:i + n], data[i + 1:i + 1 + n].reshape(-1)
        if uploaded:
            x, y = x.to(device), y.to(device)
        hidden = state["hidden"]
        if hidden is None:
            hidden = tuple(torch.zeros(layers, batch, width, device=device) for _ in range(2))
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        out, hidden = model(x, hidden)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        if opt is not None:
            opt.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-20.0)
        state.update(i=i + n, n=state["n"] + 1, hidden=hidden)
        return loss.item()
    return step


def _gpt_steps(torch, device):
    from fused import TinyGPT
    model = TinyGPT(vocab=512, d=64, heads=4, layers=12, seq=64).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (4, 64), generator=g).to(device)
    y = torch.randint(0, 512, (4, 64), generator=g).to(device)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 512), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _moving_slice_steps(torch, device):
    nn = torch.nn
    emb, lin = nn.Embedding(1000, 64).to(device), nn.Linear(64, 1000).to(device)
    opt = torch.optim.SGD(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
    data = torch.randint(0, 1000, (4000, 20), generator=torch.Generator().manual_seed(0)).to(device)
    state = {"i": 0}

    def step():
        i = state["i"]
        x, y = data[i:i + 35], data[i + 1:i + 36]
        loss = nn.functional.cross_entropy(lin(emb(x)).view(-1, 1000), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["i"] = i + 35
        return loss.item()
    return step


def _gan_steps(torch, device, nz=100, width=8, batch=8):
    nn = torch.nn

    def block(conv, c_out, act, norm=True):
        return [conv, nn.BatchNorm2d(c_out), act] if norm else [conv, act]
    w = width
    net_g = nn.Sequential(
        *block(nn.ConvTranspose2d(nz, w * 8, 4, 1, 0, bias=False), w * 8, nn.ReLU(True)),
        *block(nn.ConvTranspose2d(w * 8, w * 4, 4, 2, 1, bias=False), w * 4, nn.ReLU(True)),
        *block(nn.ConvTranspose2d(w * 4, w * 2, 4, 2, 1, bias=False), w * 2, nn.ReLU(True)),
        *block(nn.ConvTranspose2d(w * 2, w, 4, 2, 1, bias=False), w, nn.ReLU(True)),
        nn.ConvTranspose2d(w, 3, 4, 2, 1, bias=False), nn.Tanh()).to(device)
    net_d = nn.Sequential(
        *block(nn.Conv2d(3, w, 4, 2, 1, bias=False), w, nn.LeakyReLU(0.2, True), norm=False),
        *block(nn.Conv2d(w, w * 2, 4, 2, 1, bias=False), w * 2, nn.LeakyReLU(0.2, True)),
        *block(nn.Conv2d(w * 2, w * 4, 4, 2, 1, bias=False), w * 4, nn.LeakyReLU(0.2, True)),
        *block(nn.Conv2d(w * 4, w * 8, 4, 2, 1, bias=False), w * 8, nn.LeakyReLU(0.2, True)),
        nn.Conv2d(w * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid()).to(device)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    criterion = nn.BCELoss()
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(batch, 3, 64, 64, generator=g) * 2 - 1 for _ in range(4)]  # host batches
    state = {"n": 0}

    def step():
        real = images[state["n"] % len(images)].to(device)
        state["n"] += 1
        net_d.zero_grad()
        label = torch.full((batch,), 1.0, device=device)
        output = net_d(real).view(-1)
        err_real = criterion(output, label)
        err_real.backward()
        output.mean().item()
        fake = net_g(torch.randn(batch, nz, 1, 1, device=device))
        label.fill_(0.0)
        output = net_d(fake.detach()).view(-1)
        err_fake = criterion(output, label)
        err_fake.backward()
        output.mean().item()
        opt_d.step()
        net_g.zero_grad()
        label.fill_(1.0)
        output = net_d(fake).view(-1)
        err_g = criterion(output, label)
        err_g.backward()
        output.mean().item()
        opt_g.step()
        (err_real + err_fake).item()
        return err_g.item()
    return step


def _timed(torchtpu, step, n):
    """(seconds, compile seconds waited for, compilations) of n calls of step."""
    before = torchtpu.metrics.snapshot()
    start = time.perf_counter()
    for _ in range(n):
        step()
    took = time.perf_counter() - start
    after = torchtpu.metrics.snapshot()
    return (took, after["compile_seconds"] - before["compile_seconds"],
            _compilations(torchtpu) - before["compilations"] - before.get("graphs_compiled", 0))


def _background_seconds(torchtpu):
    return torchtpu.metrics.snapshot().get("background_compile_seconds", 0.0)


def _worker(workload, mode):
    import torch

    import torchtpu
    torchtpu.set_eager_mode(mode)
    torch.manual_seed(0)
    device = torchtpu.get_device()
    if workload == "lstm varying":
        fixed = _lstm_steps(torch, device, [64])
        took, compile_s, compiles = _timed(torchtpu, fixed, 24)
        rows = [{"workload": "lstm fixed (24 steps at 64)", "mode": mode, "steps": 24, "first": took,
                 "steady_ms": float("nan"), "compile_s": compile_s, "background_s": float("nan"),
                 "later": compiles}]
        varying = _lstm_steps(torch, device, VARYING)
        took, compile_s, compiles = _timed(torchtpu, varying, 24)
        rows.append({"workload": "lstm varying (24 steps, 17..64, after it)", "mode": mode,
                     "steps": 24, "first": took, "steady_ms": float("nan"), "compile_s": compile_s,
                     "background_s": float("nan"), "later": compiles})
        return rows
    if workload.startswith("lstm uploaded"):
        step = _lstm_steps(torch, device, VARYING if workload.endswith("varying") else [64], uploaded=True)
        took, compile_s, compiles = _timed(torchtpu, step, 24)
        return [{"workload": workload + " (24 steps)", "mode": mode, "steps": 24, "first": took,
                 "steady_ms": float("nan"), "compile_s": compile_s, "background_s": float("nan"),
                 "later": compiles}]
    step = {"lstm": lambda: _lstm_steps(torch, device, [35]), "gpt": lambda: _gpt_steps(torch, device),
            "moving slice": lambda: _moving_slice_steps(torch, device),
            "gan": lambda: _gan_steps(torch, device)}[workload]()
    first, compile_s, _ = _timed(torchtpu, step, 2)
    rest, more_s, later = _timed(torchtpu, step, 8)
    background_s = _background_seconds(torchtpu)
    torchtpu.wait_for_compiles()  # the steady step: what runs once everything is compiled
    step()
    background_s = _background_seconds(torchtpu)
    steady = []
    for _ in range(15):
        start = time.perf_counter()
        step()
        steady.append(time.perf_counter() - start)
    return [{"workload": workload, "mode": mode, "steps": 10, "first": first + rest,
             "steady_ms": statistics.median(steady) * 1e3, "compile_s": compile_s + more_s,
             "background_s": background_s, "later": later}]


def recompiles(workloads=WORKLOADS, modes=MODES, timeout=1800):
    rows = []
    for workload in workloads:
        for mode in modes:
            rows += worker_rows(__file__, [workload, mode], timeout)
    return rows


def _growth_worker(bptt, how):
    """One step of the LSTM model unrolled over bptt steps, every fused graph
    compiled when met (TORCHTPU_FUSED_COMPILE=sync), so that its compile
    time is what the step waits for; how: "whole" compiles each graph as
    one program, "split" as pieces where its op stream repeats."""
    os.environ["TORCHTPU_FUSED_COMPILE"] = "sync"
    if how == "whole":
        os.environ["TORCHTPU_FUSED_SPLIT_OPS"] = "0"
    import torch

    import torchtpu
    torchtpu.set_eager_mode("fused")
    torch.manual_seed(0)
    _lstm_steps(torch, torchtpu.get_device(), [bptt])()
    s = torchtpu.metrics.snapshot()
    sizes = s["fused_ops"]  # ops in a graph -> graphs of that size run
    ops = sum(n * count for n, count in sizes.items())
    programs = s["graphs_compiled"] - s["graphs_split"] + s["piece_programs"]
    return [{"bptt": bptt, "how": how, "graphs": s["graphs_compiled"], "largest": max(sizes, key=int),
             "programs": programs, "compile_s": s["compile_seconds"],
             "ms_per_op": s["compile_seconds"] / ops * 1e3}]


def graph_growth(lengths=(5, 10, 20, 35), timeout=900):
    """Compile seconds of the LSTM step's fused graphs against their length,
    compiled whole and split where they repeat."""
    rows = []
    for bptt in lengths:
        for how in ("whole", "split"):
            rows += worker_rows(__file__, ["growth", f"{bptt}:{how}"], timeout)
    return rows


graph_growth.title = "Fused graph compile time against graph length (LSTM step, fresh process)"
graph_growth.columns = [("bptt", "time steps unrolled", "{}"), ("how", "compiled", "{}"),
                        ("graphs", "graphs", "{}"), ("largest", "ops in the largest", "{}"),
                        ("programs", "programs compiled", "{}"),
                        ("compile_s", "compile seconds", "{:.1f}"),
                        ("ms_per_op", "ms per op", "{:.1f}")]


recompiles.title = "Compilation a user waits for (fresh process, empty cache)"
recompiles.columns = [("workload", "workload", "{}"), ("mode", "mode", "{}"),
                      ("steps", "first steps", "{}"),
                      ("first", "their time (s)", "{:.1f}"),
                      ("steady_ms", "steady step (ms)", "{:.1f}"),
                      ("compile_s", "compiling, waited (s)", "{:.1f}"),
                      ("background_s", "compiling in background (s)", "{:.1f}"),
                      ("later", "compilations (after step 2; varying: all)", "{}")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, os.path.join(HERE, ".."))
        if args.worker[0] == "growth":
            bptt, how = args.worker[1].split(":")
            print_rows(_growth_worker(int(bptt), how))
        else:
            print_rows(_worker(*args.worker))
    else:
        print(table(recompiles, recompiles(args.workloads, args.modes)))
