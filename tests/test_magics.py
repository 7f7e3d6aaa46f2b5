"""The IPython extension (%load_ext torchtpu), driven through an IPython shell."""
import os

import pytest

pytest.importorskip("IPython")

import torch  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402

import torchtpu  # noqa: E402


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "torchtpu")
    shell.run_cell("import torch")
    shell.colors = "nocolor"
    return shell


@pytest.fixture(autouse=True)
def _restore_mode():
    mode = torchtpu.get_eager_mode()
    yield
    torchtpu.set_eager_mode(mode)


def test_tpu_mode_prints_current(ip, capsys):
    with torchtpu.eager_mode("strict"):
        ip.run_line_magic("tpu_mode", "")
        assert capsys.readouterr().out.strip() == "strict"


@pytest.mark.parametrize("name", ["debug", "fused", "strict"])
def test_tpu_mode_switches(ip, capsys, name):
    ip.run_line_magic("tpu_mode", name)
    assert torchtpu.get_eager_mode() == name
    assert capsys.readouterr().out.strip() == f"torchtpu eager mode: {name}"
    # Through a cell, as a user types it.
    ip.run_cell("%tpu_mode")
    assert capsys.readouterr().out.strip() == name


def test_tpu_mode_rejects_unknown(ip):
    with pytest.raises(UsageError, match="unknown eager mode 'lazy'"):
        ip.run_line_magic("tpu_mode", "lazy")


def test_tpu_metrics(ip):
    torchtpu.metrics.reset()
    (torch.ones(3, device="tpu") * 2).cpu()
    report = ip.run_line_magic("tpu_metrics", "")
    assert "ops_dispatched" in report
    html = report._repr_html_()
    assert html.startswith("<table>") and "<td>ops_dispatched</td>" in html
    # A cell ending in %tpu_metrics displays it (text and HTML).
    formatted, _ = ip.display_formatter.format(report)
    assert "<table>" in formatted["text/html"]


def test_cell_error_traceback_hides_internals(ip, capsys):
    """IPython shows the failing cell's line, not torchtpu/torch/JAX frames."""
    ip.run_cell("a = torch.ones(3, device='tpu')\nb = torch.ones(4, device='tpu')\nc = a + b\n")
    out = capsys.readouterr()
    shown = out.out + out.err
    assert "RuntimeError" in shown and "c = a + b" in shown
    assert "dispatch" + os.sep not in shown and "tensor.py" not in shown


def test_tensors_print_as_in_pytorch(ip, capsys):
    ip.run_cell("torch.arange(3, device='tpu')")
    assert "tensor([0, 1, 2], device='tpu:0')" in capsys.readouterr().out
