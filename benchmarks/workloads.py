"""The benchmarks' models and batches, and a plain PyTorch training step:
no torchtpu here, so PyTorch's own CUDA rows (benchmarks/gpu.py) run in a
process without it (PyTorch allows one accelerator backend per process for
autograd: with torchtpu registered, a CUDA backward fails, pytorch#161129)."""
import torch
import torch.nn.functional as F


def mlp(sizes=(784, 1024, 1024, 10)):
    a, b, c, d = sizes
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(),
                               torch.nn.Linear(b, c), torch.nn.ReLU(),
                               torch.nn.Linear(c, d))


def mlp_batch(batch=128, features=784, classes=10):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, features, generator=g),
            torch.randint(0, classes, (batch,), generator=g))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=512, d=256, heads=4, layers=4, seq=128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def gpt_batch(batch=8, seq=128, vocab=512):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1).contiguous()


def loss_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
    loss.backward()
    opt.step()
    return loss


def step_reading_loss(model, opt, x, y):
    """run(): one training step that ends reading the loss, as a training
    loop that logs it does."""
    return lambda: loss_step(model, opt, x, y).item()


def torch_step_fn(make_model, make_batch, device):
    """One AdamW training step of a fresh model (seeded) in PyTorch's own
    eager mode on device, as run(); it ends reading the loss."""
    torch.manual_seed(0)
    model = make_model().to(device)
    x, y = (t.to(device) for t in make_batch())
    return step_reading_loss(model, torch.optim.AdamW(model.parameters(), lr=1e-4), x, y)
