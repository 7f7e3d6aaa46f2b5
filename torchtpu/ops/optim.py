"""torch.optim's fused optimizer steps: Adam, AdamW, SGD and Adagrad.

Each lowering is the functional op (`_fused_adamw`, ...) over the whole
parameter list; the dispatcher writes the results back into the parameters,
gradients and state of the in-place op (`_fused_adamw_`, ...). The update
follows PyTorch's fused kernels (aten/src/ATen/native/Fused*.cpp): computed
in float32 for bf16/f16 (float64 for float64), gradients unscaled by
grad_scale and written back, and with found_inf == 1 nothing changes. The
step tensors are incremented by torch.optim before the call, not here.

The learning rate is traced (a scheduler changes it every step without a new
kernel); the other hyperparameters are constants of the kernel.
"""
import jax.numpy as jnp

from .registry import lower
from .util import bad_input

from ..compat import aten


def _opmath(dtype):
    """The dtype PyTorch's fused kernels compute a tensor of dtype in."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _check_lists(params, unused=None, **lists):
    """PyTorch's checks of the lists' lengths (unused: the name and value of
    a list the flags leave unread, which must be empty), and that each state
    tensor has its parameter's shape (CUDA checks it; CPU reads out of
    bounds)."""
    if unused is not None and len(unused[1]):
        raise bad_input(RuntimeError, f"Expected {unused[0]}.empty() to be true, but got false.")
    n = len(params)
    for name, tensors in lists.items():
        if len(tensors) != n:
            raise bad_input(RuntimeError,
                            f"Expected {name}.size() == n_tensors to be true, but got false.")
        if name == "state_steps":
            continue
        for i, (p, t) in enumerate(zip(params, tensors)):
            if t.shape != p.shape:
                raise bad_input(RuntimeError, f"{name}[{i}] has shape {list(t.shape)}, but its "
                                f"parameter has shape {list(p.shape)}")


def _unscaled(grad, grad_scale, maximize, dtype):
    """(the gradient the update uses, the gradient written back)."""
    g = grad.astype(dtype)
    if grad_scale is not None:
        g = g / grad_scale.reshape(()).astype(dtype)
        written = g.astype(grad.dtype)
    else:
        written = grad
    return (-g if maximize else g), written


def _skip_if_found_inf(found_inf, new, old):
    """new, or old where found_inf says the step had an inf/NaN gradient."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1
    return [[jnp.where(skip, o, n) for n, o in zip(ns, os)] for ns, os in zip(new, old)]


def _adam(decoupled):
    def lowering(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr,
                 beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale=None,
                 found_inf=None):
        maxima = {"max_exp_avg_sqs": max_exp_avg_sqs}
        _check_lists(self, None if amsgrad else ("max_exp_avg_sqs", max_exp_avg_sqs),
                     grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                     state_steps=state_steps, **(maxima if amsgrad else {}))
        new = [[], [], [], [], []]
        for i, (p, g, m, v, step) in enumerate(zip(self, grads, exp_avgs, exp_avg_sqs,
                                                   state_steps)):
            dt = _opmath(p.dtype)
            step = step.reshape(()).astype(dt)
            rate = jnp.asarray(lr).reshape(()).astype(dt)
            bias1 = 1 - jnp.power(jnp.asarray(beta1, dt), step)
            bias2_sqrt = jnp.sqrt(1 - jnp.power(jnp.asarray(beta2, dt), step))
            g, g_written = _unscaled(g, grad_scale, maximize, dt)
            param = p.astype(dt)
            if weight_decay != 0:
                if decoupled:
                    param = param * (1 - rate * weight_decay)
                else:
                    g = g + param * weight_decay
            mean = m.astype(dt)
            mean = mean + (1 - beta1) * (g - mean)
            sq = v.astype(dt) * beta2 + (1 - beta2) * g * g
            if amsgrad:
                peak = jnp.maximum(max_exp_avg_sqs[i].astype(dt), sq)
                denom = jnp.sqrt(peak) / bias2_sqrt + eps
                new[4].append(peak.astype(max_exp_avg_sqs[i].dtype))
            else:
                denom = jnp.sqrt(sq) / bias2_sqrt + eps
            param = param - (rate / bias1) * mean / denom
            new[0].append(param.astype(p.dtype))
            new[1].append(g_written)
            new[2].append(mean.astype(m.dtype))
            new[3].append(sq.astype(v.dtype))
        old = [list(self), list(grads), list(exp_avgs), list(exp_avg_sqs),
               list(max_exp_avg_sqs)]
        return tuple(_skip_if_found_inf(found_inf, new, old))
    lowering.dynamic_args = ("lr",)
    return lowering


fused_adam = lower(aten._fused_adam.default, aten._fused_adam.tensor_lr)(_adam(False))
fused_adamw = lower(aten._fused_adamw.default, aten._fused_adamw.tensor_lr)(_adam(True))


@lower(aten._fused_sgd.default, aten._fused_sgd.tensor_lr)
def fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening,
              nesterov, maximize, is_first_step, grad_scale=None, found_inf=None):
    buffers = {"momentum_buffer_list": momentum_buffer_list}
    _check_lists(self, None if momentum != 0 else ("momentum_buffer_list", momentum_buffer_list),
                 grads=grads, **(buffers if momentum != 0 else {}))
    new = [[], [], []]
    for i, (p, g) in enumerate(zip(self, grads)):
        dt = _opmath(p.dtype)
        rate = jnp.asarray(lr).reshape(()).astype(dt)
        g, g_written = _unscaled(g, grad_scale, maximize, dt)
        param = p.astype(dt)
        if weight_decay != 0:
            g = g + param * weight_decay
        if momentum != 0:
            buf_in = momentum_buffer_list[i]
            buf = g if is_first_step else buf_in.astype(dt) * momentum + (1 - dampening) * g
            new[2].append(buf.astype(buf_in.dtype))
            g = g + momentum * buf if nesterov else buf
        new[0].append((param - rate * g).astype(p.dtype))
        new[1].append(g_written)
    old = [list(self), list(grads), list(momentum_buffer_list)]
    return tuple(_skip_if_found_inf(found_inf, new, old))


fused_sgd.dynamic_args = ("lr",)


def _adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize,
             grad_scale, found_inf):
    _check_lists(self, grads=grads, state_sums=state_sums, state_steps=state_steps)
    new = [[], [], []]
    for p, g, s, step in zip(self, grads, state_sums, state_steps):
        dt = _opmath(p.dtype)
        rate = jnp.asarray(lr).reshape(()).astype(dt)
        clr = rate / (1 + (step.reshape(()).astype(dt) - 1) * lr_decay)
        g, g_written = _unscaled(g, grad_scale, maximize, dt)
        param = p.astype(dt)
        if weight_decay != 0:
            g = g + param * weight_decay
        total = s.astype(dt) + g * g
        param = param - clr * g / (jnp.sqrt(total) + eps)
        new[0].append(param.astype(p.dtype))
        new[1].append(g_written)
        new[2].append(total.astype(s.dtype))
    return _skip_if_found_inf(found_inf, new, [list(self), list(grads), list(state_sums)])


@lower(aten._fused_adagrad.default)
def fused_adagrad(self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps,
                  maximize, grad_scale=None, found_inf=None):
    # This overload also writes state_steps: the kernel leaves them as they are.
    return tuple(_adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps,
                          maximize, grad_scale, found_inf)) + (list(state_steps),)


@lower(aten._fused_adagrad.tensor_lr)
def fused_adagrad_tensor_lr(self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay,
                            eps, maximize, grad_scale=None, found_inf=None):
    return tuple(_adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps,
                          maximize, grad_scale, found_inf))


fused_adagrad.dynamic_args = fused_adagrad_tensor_lr.dynamic_args = ("lr",)
