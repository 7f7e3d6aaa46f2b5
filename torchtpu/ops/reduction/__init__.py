"""Reductions, scans, sorting and selection, searching, histograms and
segment reductions.

- `common`: helpers the sub-modules share (accumulation dtype, NaN test,
  dtype rejections)
- `sums`: sums, products, any/all, extrema, moments, logsumexp, norms,
  hash_tensor
- `scan`: cumsum, cumprod, logcumsumexp, cummax, cummin
- `sort`: sort, argsort, topk, mode, kthvalue, median, with the replay of
  CPU's partition steps (REPLAY_MAX)
- `search`: searchsorted, bucketize, histc, histogram, histogramdd
- `segment`: segment_reduce and its backward

Importing the package registers every lowering of its sub-modules.
"""
from . import sums, scan, sort, search, segment  # noqa: F401
from .sort import REPLAY_MAX  # noqa: F401
