"""torch.fft on tpu vs CPU: values, dtypes, every norm mode, and gradients,
with no CPU fallback."""
import pytest
import torch

from conftest import compare, make

NORMS = [None, "ortho", "forward"]
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_real_input(dtype, norm):
    x = make(dtype, (4, 6))
    for fn in (torch.fft.fft, torch.fft.ifft, torch.fft.rfft, torch.fft.ihfft,
               torch.fft.fft2, torch.fft.rfftn, torch.fft.ihfftn):
        compare(lambda t: fn(t, norm=norm), x, grad=False)
    # Padding and trimming the signal length, and a non-last dim.
    compare(lambda t: torch.fft.rfft(t, n=9, dim=0, norm=norm), x, grad=False)
    compare(lambda t: torch.fft.fft(t, n=4, norm=norm), x, grad=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
def test_complex_input(dtype, norm):
    z = make(dtype.to_complex(), (4, 6))
    for fn in (torch.fft.fft, torch.fft.ifft, torch.fft.fft2, torch.fft.ifftn,
               torch.fft.irfft, torch.fft.hfft, torch.fft.irfftn):
        compare(lambda t: fn(t, norm=norm), z, grad=False)
    # c2r output length from n (odd and even), normalized by it.
    compare(lambda t: torch.fft.irfft(t, n=11, norm=norm), z, grad=False)
    compare(lambda t: torch.fft.irfftn(t, s=(3, 8), norm=norm), z, grad=False)
    compare(lambda t: torch.fft.hfft(t, n=7, dim=0, norm=norm), z, grad=False)


def test_result_dtypes():
    for dtype, cdtype in ((torch.float32, torch.complex64), (torch.float64, torch.complex128)):
        x = make(dtype, (8,)).to("tpu")
        assert torch.fft.rfft(x).dtype == cdtype
        assert torch.fft.fft(x).dtype == cdtype
        assert torch.fft.irfft(torch.fft.rfft(x)).dtype == dtype


@pytest.mark.parametrize("norm", [None, "ortho"])
def test_backward(norm):
    x = make(torch.float64, (3, 8))
    compare(lambda t: torch.fft.rfft(t, norm=norm).abs(), x)
    compare(lambda t: torch.fft.irfft(torch.fft.rfft(t) * 2, n=8, norm=norm), x)
    compare(lambda t: torch.fft.fft2(t, norm=norm).real, x)
    compare(lambda t: torch.fft.ihfft(t, norm=norm).imag, x)


def test_complex_and_conj():
    a, b = make(torch.float32, (3, 4)), make(torch.float32, (4,), seed=1)
    compare(torch.complex, a, b, grad=False)
    compare(torch.complex, a.double(), b.double(), grad=False)
    z = make(torch.complex64, (3, 4))
    compare(lambda t: t.conj() + 0, z, grad=False)
    compare(torch.conj_physical, z, grad=False)


def test_polar():
    a, b = make(torch.float32, (3, 4)).abs(), make(torch.float32, (4,), seed=1)
    compare(torch.polar, a, b, grad=False)
    compare(torch.polar, a.double(), b.double(), grad=False)


def test_out_variants():
    x = make(torch.float32, (4, 6))
    compare(lambda t: torch.fft.ifft(t, out=torch.empty(4, 6, dtype=torch.complex64,
                                                          device=t.device)), x, grad=False)
    compare(lambda t: torch.fft.rfft(t, out=torch.empty(4, 4, dtype=torch.complex64,
                                                          device=t.device)), x, grad=False)
