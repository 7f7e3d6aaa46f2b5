"""Automatic mixed precision on tpu: torch.autocast("tpu") with CUDA's op
policy, and GradScaler's ops on the device.

torch.autocast("tpu") already flips PyTorch's per-thread autocast state for
the PrivateUse1 device; what a backend must bring is the kernels at the
AutocastPrivateUse1 dispatch key (PyTorch registers none there). Each op of
POLICY gets one that casts its tpu floating-point inputs and calls the op
again below autocast, as CUDA's C++ wrappers do; every other op falls
through to the usual kernels. Casts run ahead of autograd, so backward
follows the same dtypes.
"""
import functools
import weakref

import torch

from .ops import amp as grad_scaler_ops
from .ops.pointwise import _TORCH_NAMES
from .tensor import TpuTensor, on_device

from .compat import aten

# CUDA's autocast policy (PyTorch's aten/src/ATen/autocast_mode.cpp), for
# the aten ops CUDA registers at its Autocast key; tests check it is the
# same set. Policies:
# - lower_precision_fp: inputs cast to the autocast dtype (bf16/fp16);
# - fp32: inputs cast to float32;
# - fp32_set_opt_dtype: run with dtype=float32 unless the call gave one
#   (the op reads lower-precision inputs and computes in float32);
# - fp32_append_dtype: call the overload taking dtype, with float32;
# - promote: inputs cast to the widest floating type among them;
# - banned: raises, as on CUDA.
# Ops not listed keep their inputs' dtypes. cat and stack are not listed
# (CUDA dropped them): they promote to the widest input type by themselves.
POLICY = {
    "lower_precision_fp": (
        "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
        "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
        "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
        "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
        "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"),
    "fp32": (
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
        "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
        "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
        "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
    "fp32_set_opt_dtype": (
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
        "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
        "sum.dim_IntList"),
    # (the op, the overload it calls with dtype=float32)
    "fp32_append_dtype": (
        ("norm.Scalar", "norm.ScalarOpt_dtype"),
        ("norm.ScalarOpt_dim", "norm.ScalarOpt_dim_dtype")),
    "promote": (
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
        "index_put", "tensordot", "scatter_add"),
    "banned": ("binary_cross_entropy",),
}

# CUDA's message for the banned op, word for word.
_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")


def op_of(name):
    """The OpOverload named 'op' or 'op.overload'."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


# ---- casts -------------------------------------------------------------------

def _eligible(t):
    """Whether autocast casts t: a floating-point tpu tensor, not float64
    (CUDA's is_eligible). By device, not class: under torch.compile the
    tensors traced are fake ones on tpu, and get the casts too."""
    if not on_device(t):
        return False
    dtype = t.dtype
    return dtype.is_floating_point and dtype is not torch.float64


# The weight cache, one for all threads as PyTorch's is: id(source) ->
# (weakref to source, source's version, cast). The weakref tells a new tensor
# at a reused address from the one cast; the version tells a weight changed
# in place since (an optimizer step inside the region), which is cast again
# rather than served stale.
_casts = {}


def _cached_cast(dtype, t, lower):
    """t as dtype if autocast casts it. Casts of float32 leaves that need
    grad (model weights) to the autocast dtype are cached while
    cache_enabled and outside inference mode, until the outermost autocast
    region exits (CUDA's heuristic), so a weight used twice is cast once."""
    if type(t) is not TpuTensor and not on_device(t):  # (a TpuTensor is: no device object made)
        return t
    src = t.dtype
    if src is dtype or not src.is_floating_point or src is torch.float64:
        return t
    # (Only real tensors are cached: a traced one lives for its trace.)
    if (dtype is lower and src is torch.float32 and type(t) is TpuTensor
            and t.requires_grad and t.is_leaf
            and not t._is_view() and torch.is_autocast_cache_enabled()
            and not torch._C._is_cached_tensor(t) and not torch.is_inference_mode_enabled()):
        hit = _casts.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        # Cast with autograd on, as PyTorch does: a cast made under no_grad
        # may be served to a later use that needs its gradient.
        with torch.enable_grad():
            cast = t.to(dtype)
        _casts[id(t)] = (weakref.ref(t), t._version, cast)
        return cast
    return t.to(dtype)


def _cast(dtype, value, lower):
    """Tensors (and tensors in lists) in value cast by _cached_cast."""
    if isinstance(value, torch.Tensor):
        return _cached_cast(dtype, value, lower)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(dtype, v, lower) for v in value)
    return value


def _call_cast(op, dtype, lower, args, kwargs):
    """op on its arguments cast by _cast."""
    return op(*[_cast(dtype, a, lower) for a in args],
              **{k: _cast(dtype, v, lower) for k, v in kwargs.items()})


def _widest(lower, values):
    """The type a promote op runs in: float32 if any eligible input is
    float32, else the autocast dtype (CUDA's promote_type; float64 inputs
    are ignored and other floating types are an error there too)."""
    current = lower
    for v in values:
        if isinstance(v, (list, tuple)):
            current = _widest(current, v)
        elif _eligible(v):
            if current is torch.float32 or v.dtype is torch.float32:
                current = torch.float32
            elif not (current is lower and v.dtype is lower):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def clear_cache():
    """Drop the cached weight casts."""
    _casts.clear()


def _also_clearing_ours(clear_autocast_cache):
    """torch.clear_autocast_cache, which autocast calls when its outermost
    region exits, clearing this cache too (PyTorch's own lives in C++)."""
    @functools.wraps(clear_autocast_cache)
    def wrapper():
        clear_autocast_cache()
        clear_cache()
    wrapper.clears_tpu_casts = True
    return wrapper


# ---- kernels, one per policy --------------------------------------------------

def _lower_precision_fp(op):
    def kernel(*args, **kwargs):
        with torch._C._DisableAutocast():
            lower = torch.get_autocast_dtype("tpu")
            return _call_cast(op, lower, lower, args, kwargs)
    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        with torch._C._DisableAutocast():
            lower = torch.get_autocast_dtype("tpu")
            return _call_cast(op, torch.float32, lower, args, kwargs)
    return kernel


def _fp32_set_opt_dtype(op):
    at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")

    def kernel(*args, **kwargs):
        with torch._C._DisableAutocast():
            # Inputs stay as they are; an ineligible first input keeps the
            # op's own type promotion (CUDA's rule).
            if _eligible(args[0]):
                if at < len(args):
                    if args[at] is None:
                        args = args[:at] + (torch.float32,) + args[at + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
            return op(*args, **kwargs)
    return kernel


def _positional(op, args, kwargs):
    """All of op's positional arguments, defaults filled in."""
    full = list(args)
    for a in op._schema.arguments[len(args):]:
        if a.kwarg_only:
            break
        full.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return full


def _fp32_append_dtype(op, target):
    def kernel(*args, **kwargs):
        with torch._C._DisableAutocast():
            dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*_positional(op, args, kwargs), dtype=dtype)
    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        with torch._C._DisableAutocast():
            lower = torch.get_autocast_dtype("tpu")
            dtype = _widest(_widest(lower, args), kwargs.values())
            return _call_cast(op, dtype, lower, args, kwargs)
    return kernel


def _banned(op):
    def kernel(*args, **kwargs):
        raise RuntimeError(_BANNED_MESSAGE)
    return kernel


# ---- GradScaler's ops ----------------------------------------------------------

def _require(ok, message, exc=RuntimeError):
    if not ok:
        raise exc(message)


def _one_float(t, name):
    _require(t.numel() == 1, f"{name} must be a 1-element tensor.")
    _require(t.dtype is torch.float32, f"{name} must be a float tensor.")


def _check_unscale_args(grads, found_inf, inv_scale):
    """PyTorch's checks in _amp_foreach_non_finite_check_and_unscale_ that its
    meta kernel lacks, raised at the call (the dispatcher asks accepts()
    before each call of the lowering)."""
    _one_float(inv_scale, "inv_scale")
    _one_float(found_inf, "found_inf")
    for g in grads:
        _require(g.is_floating_point(),
                 '"_amp_foreach_non_finite_check_and_unscale_tpu" not implemented for '
                 f"'{_TORCH_NAMES[str(g.dtype).split('.')[1]]}'", NotImplementedError)
    return True


def _check_update_scale_args(scale, growth_tracker, found_inf, *factors):
    """The same for _amp_update_scale_."""
    _require(growth_tracker.numel() == 1, "growth_tracker must be a 1-element tensor.")
    _require(scale.numel() == 1, "current_scale must be a 1-element tensor.")
    _require(found_inf.numel() == 1, "found_inf must be a 1-element tensor.")
    _require(growth_tracker.dtype is torch.int32, "growth_tracker must be an int tensor.")
    _require(scale.dtype is torch.float32, "current_scale must be a float tensor.")
    _require(found_inf.dtype is torch.float32, "found_inf must be a float tensor.")
    return True


# ---- registration ---------------------------------------------------------------

_KERNELS = {"lower_precision_fp": _lower_precision_fp, "fp32": _fp32,
            "fp32_set_opt_dtype": _fp32_set_opt_dtype, "promote": _promote, "banned": _banned}

_libraries = []


def register():
    """Install the autocast kernels for tpu and the cache clearing."""
    if _libraries:
        return
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    policy_ops = torch.library.Library("aten", "IMPL")
    for policy, names in POLICY.items():
        for name in names:
            if policy == "fp32_append_dtype":
                name, target = name
                kernel = _fp32_append_dtype(op_of(name), op_of(target))
            else:
                kernel = _KERNELS[policy](op_of(name))
            policy_ops.impl(name, kernel, "AutocastPrivateUse1")
    _libraries.extend([everything, policy_ops])
    grad_scaler_ops.amp_foreach_non_finite_check_and_unscale.accepts = _check_unscale_args
    grad_scaler_ops.amp_update_scale.accepts = _check_update_scale_args
    if not getattr(torch.clear_autocast_cache, "clears_tpu_casts", False):
        torch.clear_autocast_cache = _also_clearing_ours(torch.clear_autocast_cache)


__all__ = ["POLICY", "register", "clear_cache", "op_of"]
