"""examples/debugging.ipynb runs top to bottom in a fresh Python kernel, and
each cell shows what the story says it shows."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "debugging.ipynb")


def _text(cell):
    """Everything a code cell showed: streams, results, displays (plain text)."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
    return "".join(parts)


def _cell(nb, marker):
    return next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)


def test_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


def test_notebook_runs_and_shows_the_story(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_keep = os.environ.get("TORCHTPU_DEBUG")
    os.environ.pop("TORCHTPU_DEBUG", None)
    try:
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        if env_keep is not None:
            os.environ["TORCHTPU_DEBUG"] = env_keep
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not any(o["output_type"] == "error" for o in cell.outputs), _text(cell)

    assert "tpu:0 | eager mode: strict" in _text(_cell(nb, "get_device()"))

    model_out = _text(_cell(nb, "class Net("))
    assert "hidden: (4, 16) torch.float32 tpu:0" in model_out
    assert "device='tpu:0'" in model_out and "grad_fn=<AddmmBackward0>" in model_out

    shape = _text(_cell(nb, "torch.randn(4, 9"))
    assert "RuntimeError:" in shape
    assert "raised at: forward: h = torch.relu(self.fc1(x))" in shape

    nan = _text(_cell(nb, "set_check_nans(True)"))
    assert "aten.log.default produced NaN or Inf" in nan and "issued at" in nan

    report_cell = _cell(nb, "metrics.report()")
    html = [o["data"]["text/html"] for o in report_cell.outputs if "text/html" in o.get("data", {})]
    assert html and "<table>" in html[0] and "ops_dispatched" in html[0]
    assert "loss:" in _text(report_cell)

    assert _text(_cell(nb, "%load_ext torchtpu")).strip() == "strict"

    fused = _text(_cell(nb, "def train("))
    lines = dict(line.split(":", 1) for line in fused.strip().splitlines())
    assert "ms/step" in lines["strict"] and "ms/step" in lines["fused"]
    assert float(lines["speed-up"].strip().rstrip("x")) > 0
    # The same training in both modes reaches the same loss.
    s_loss = float(lines["strict"].split("final loss")[1])
    f_loss = float(lines["fused"].split("final loss")[1])
    assert abs(s_loss - f_loss) <= 1e-4 * max(1.0, abs(s_loss))
