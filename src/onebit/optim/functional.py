"""The update rules of LAMB, 1-bit LAMB, 1-bit Adam and 0/1 Adam over flat state (ALGORITHM.md).

Every function updates all parameters of a :class:`~onebit.optim._flat.FlatState` at once:
a few whole-buffer passes, per-parameter norms in one call, per-parameter scalars (trust
ratios, factors) kept in device vectors, so a step makes no host synchronisation per
tensor. Hyper-parameters come from each parameter's group. ``active`` (a bool per
parameter, on the host) says which parameters take part; the others keep their state and
weights bit for bit. No bias correction anywhere.

The functions here are the torch reference. :data:`REFERENCE` gathers them as the
:class:`onebit.kernels.UpdateKernels` protocol, which the fused backends implement too
(numba's :mod:`onebit.kernels._numba_optim`, Triton's :mod:`onebit.kernels._triton_optim`);
an optimizer calls ``optimizer.updates``, the backend's or this one, selected once.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import Tensor

from onebit.coefficients import TrustBound, compression_factor, momentum_rebuild, trust_ratio
from onebit.compression import ExchangeResult
from onebit.optim._flat import FlatState

__all__ = [
    "REFERENCE",
    "lamb_step_",
    "adam_step_",
    "scaled_momentum",
    "onebit_lamb_compressed_step_",
    "onebit_adam_compressed_step_",
    "onebit_adam_per_tensor_step_",
    "predict_weights_",
    "adam_momentum_step_",
    "accumulated_update",
    "synchronised_update_",
]


# --------------------------------------------------------------------------- small maths
def _by_group(flat: FlatState, indices: Sequence[int]):
    """``(group, indices)`` of the given parameters, group by group."""
    by_group: dict[int, tuple[dict, list[int]]] = {}
    for index in indices:
        group = flat.groups[index]
        by_group.setdefault(id(group), (group, []))[1].append(index)
    return by_group.values()


def _pick(views: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
    return [views[i] for i in indices]


def _active_indices(active: Sequence[bool]) -> list[int]:
    return [index for index, is_active in enumerate(active) if is_active]


def _active_if_finite(
    flat: FlatState, grads: Sequence[Tensor | None], active: Sequence[bool], check_finite: bool
) -> list[int] | None:
    """The indices of the active parameters; ``None`` when ``check_finite`` and one of their
    gradients is not finite."""
    indices = _active_indices(active)
    if check_finite and not flat.all_finite(_pick(grads, indices)):
        return None
    return indices


def _scale_each(tensors: list[Tensor], values: Tensor) -> None:
    """``tensors[i] *= values[i]`` for a device vector ``values`` (no host sync)."""
    if tensors:
        torch._foreach_mul_(tensors, list(values.unbind()))


def _moments_(m: list[Tensor], v: list[Tensor], g: list[Tensor], group: dict) -> None:
    """``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``."""
    beta1, beta2 = group["betas"]
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)


def _adam_direction(
    out: list[Tensor],
    denom: list[Tensor],
    m: list[Tensor],
    v: list[Tensor],
    p: list[Tensor],
    group: dict,
) -> None:
    """``denom = sqrt(v) + eps``; ``out = m / denom + wd p`` (decoupled weight decay)."""
    torch._foreach_copy_(denom, v)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_copy_(out, m)
    torch._foreach_div_(out, denom)
    if group["weight_decay"]:
        torch._foreach_add_(out, p, alpha=group["weight_decay"])


def _moments_and_directions(
    flat: FlatState, grads: Sequence[Tensor | None], indices: list[int]
) -> list[Tensor]:
    """For the listed parameters: ``m, v <- moments(g)``; returns every parameter's view of
    a scratch buffer holding ``u = m / (sqrt(v) + eps) + wd p`` for the listed ones."""
    m, v, p = flat.views(flat.exp_avg), flat.views(flat.exp_avg_sq), flat.weight_views()
    update, denom = flat.views(flat.scratch(0)), flat.views(flat.scratch(1))
    for group, idx in _by_group(flat, indices):
        _moments_(_pick(m, idx), _pick(v, idx), _pick(grads, idx), group)
        _adam_direction(
            _pick(update, idx),
            _pick(denom, idx),
            _pick(m, idx),
            _pick(v, idx),
            _pick(p, idx),
            group,
        )
    return update


def _step_(flat: FlatState, indices: list[int], update: list[Tensor], steps: Tensor) -> None:
    """``p += steps[i] * update`` for each listed parameter (``steps`` on the device)."""
    weights = flat.weight_views()
    _scale_each(_pick(update, indices), steps)
    torch._foreach_add_(_pick(weights, indices), _pick(update, indices))


# --------------------------------------------------------------------------- warm-up
def lamb_step_(
    flat: FlatState,
    grads: Sequence[Tensor | None],
    active: Sequence[bool],
    check_finite: bool,
) -> tuple[Tensor, Tensor] | None:
    """One LAMB step on every active parameter with its gradient in ``grads``.

    ``m, v <- moments(g)``; ``u = m / (sqrt(v) + eps) + wd p``;
    ``c = clamp(||p|| / ||u||, c_min, c_max)`` (1 where a norm is 0); ``p <- p - lr c u``.
    Returns ``(c, defined)`` per parameter (vectors; ``c = 1`` and ``defined = False`` for
    inactive parameters), or ``None``, with nothing changed, when ``check_finite`` and a
    gradient holds NaN/Inf.
    """
    indices = _active_if_finite(flat, grads, active, check_finite)
    if indices is None:
        return None
    update = _moments_and_directions(flat, grads, indices)
    p = flat.weight_views()
    coeff, defined = trust_ratio(
        flat.norms(_pick(p, indices)),
        flat.norms(_pick(update, indices)),
        flat.segment_values(lambda g: g["min_coeff"])[indices],
        flat.segment_values(lambda g: g["max_coeff"])[indices],
    )
    _step_(flat, indices, update, -flat.segment_values(lambda g: g["lr"])[indices] * coeff)
    full_coeff = torch.ones(len(active), dtype=flat.dtype, device=flat.device)
    full_defined = torch.zeros(len(active), dtype=torch.bool, device=flat.device)
    full_coeff[indices], full_defined[indices] = coeff, defined
    return full_coeff, full_defined


def adam_step_(
    flat: FlatState,
    grads: Sequence[Tensor | None],
    active: Sequence[bool],
    check_finite: bool,
) -> bool:
    """One Adam step (no bias correction) on every active parameter with its gradient in
    ``grads``: ``m, v <- moments(g)``; ``p <- p - lr (m / (sqrt(v) + eps) + wd p)``.
    Returns False, with nothing changed, when ``check_finite`` and a gradient is not finite.
    """
    indices = _active_if_finite(flat, grads, active, check_finite)
    if indices is None:
        return False
    update = _moments_and_directions(flat, grads, indices)
    _step_(flat, indices, update, -flat.segment_values(lambda g: g["lr"])[indices])
    return True


# --------------------------------------------------------------------------- compression
def scaled_momentum(
    flat: FlatState,
    grads: Sequence[Tensor],
    scaling: Tensor,
    out: Tensor,
    active: Sequence[bool],
    only: Sequence[int] | None = None,
) -> None:
    """``out[p] = s_p (b1 m_p + (1 - b1) g_p)`` for every active parameter with its local
    gradient ``g_p`` in ``grads``; zeros for the others (the caller zeroes any padded tail
    of ``out``). With ``only``, just those parameters' ranges of ``out`` are written."""
    m, g, target = flat.views(flat.exp_avg), grads, flat.views(out)
    selected = range(len(active)) if only is None else only
    indices = [index for index in selected if active[index]]
    for group, idx in _by_group(flat, indices):
        beta1 = group["betas"][0]
        torch._foreach_copy_(_pick(target, idx), _pick(m, idx))
        torch._foreach_mul_(_pick(target, idx), beta1)
        torch._foreach_add_(_pick(target, idx), _pick(g, idx), alpha=1 - beta1)
    _scale_each(_pick(target, indices), scaling[indices])
    inactive = [target[index] for index in selected if not active[index]]
    if inactive:
        torch._foreach_zero_(inactive)


def _limit_(values: Tensor, limit: Tensor | None) -> None:
    """``values = clamp(values, -limit, limit)`` in place (``None``: no limit)."""
    if limit is not None:
        torch.clamp(values, min=limit.neg(), max=limit, out=values)


def _decode_momentum(
    flat: FlatState, packed: ExchangeResult, scaling: Tensor, limit: Tensor | None, out: Tensor
) -> list[Tensor]:
    """``m_new = clamp(decoded * (1 / s), -limit, limit)`` into ``out``; each parameter's
    view. (The decoded value is ``+-b_j``, so the product rounds once.)"""
    packed.decode(out)
    new = flat.views(out)
    torch._foreach_mul_(new, list(scaling.reciprocal().unbind()))
    _limit_(out[: flat.numel], limit)
    return new


def onebit_lamb_compressed_step_(
    flat: FlatState,
    packed: ExchangeResult,
    scratch: Tensor,
    scaling: Tensor,
    limit: Tensor | None,
    active: Sequence[bool],
    lamb_coeff_freeze: Tensor,
    last_factor: Tensor,
    trust: TrustBound | None = None,
) -> tuple[Tensor, Tensor]:
    """A compression-stage 1-bit LAMB step with the exchanged momentum; returns ``f`` and the
    coefficient the step used.

    ``m_new = clamp(decoded / s, -limit, limit)``; ``g = (m_new - b1 m) / (1 - b1)``;
    ``v_fresh = b2 v_fresh + (1 - b2) g^2``; ``m = m_new``; ``d = sqrt(v) + eps``;
    ``u0 = m / d``; ``u = u0 + wd p``; ``f`` from :func:`compression_factor`
    (``last_factor`` kept for inactive parameters); ``p <- p - lr c u`` with ``c = c_frz f``
    (no c_min/c_max clamp in this stage), bounded by ``trust`` where given. ``packed`` is the
    exchange's result, decoded on the fly or into ``scratch`` (the exchange buffer). Divisions
    by ``s`` and ``1 - b1`` are multiplications by their reciprocals.
    """
    indices = _active_indices(active)
    new = _decode_momentum(flat, packed, scaling, limit, scratch)
    m, v, p = flat.views(flat.exp_avg), flat.views(flat.exp_avg_sq), flat.weight_views()
    fresh = flat.views(flat.exp_avg_sq_fresh)
    update, denom = flat.views(flat.scratch(0)), flat.views(flat.scratch(1))
    groups = _by_group(flat, indices)
    for group, idx in groups:
        beta1, beta2 = group["betas"]
        grad = _pick(update, idx)  # g = (m_new - b1 m) / (1 - b1)
        torch._foreach_copy_(grad, _pick(new, idx))
        torch._foreach_add_(grad, _pick(m, idx), alpha=-beta1)
        torch._foreach_mul_(grad, flat.reciprocal(1 - beta1))
        torch._foreach_mul_(_pick(fresh, idx), beta2)
        torch._foreach_addcmul_(_pick(fresh, idx), grad, grad, value=1 - beta2)
        torch._foreach_copy_(_pick(m, idx), _pick(new, idx))
        without_decay = {**group, "weight_decay": 0.0}
        _adam_direction(grad, _pick(denom, idx), _pick(m, idx), _pick(v, idx), [], without_decay)
        ratio = _pick(new, idx)  # d / (sqrt(v_fresh) + eps), in the spent exchange buffer
        torch._foreach_copy_(ratio, _pick(fresh, idx))
        torch._foreach_sqrt_(ratio)
        torch._foreach_add_(ratio, group["eps"])
        torch._foreach_div_(_pick(denom, idx), ratio)
    base_norm = flat.norms(_pick(update, indices))  # ||u0||
    for group, idx in groups:
        if group["weight_decay"]:
            torch._foreach_add_(_pick(update, idx), _pick(p, idx), alpha=group["weight_decay"])
    max_ratio = flat.segment_max(flat.scratch(1)[: flat.numel])
    full_norm = flat.norms(_pick(update, indices))  # ||u||
    factor = compression_factor(
        max_ratio[indices],
        base_norm,
        full_norm,
        last_factor[indices],
        flat.segment_values(lambda g: g["factor_min"])[indices],
        flat.segment_values(lambda g: g["factor_max"])[indices],
        flat.segment_values(lambda g: g["factor_threshold"])[indices],
    )
    lr = flat.segment_values(lambda g: g["lr"])[indices]
    frozen = lamb_coeff_freeze[indices]
    steps, coefficient = -lr * frozen * factor, frozen * factor
    if trust is not None:
        steps, coefficient = trust.apply(steps, coefficient, lr, full_norm, indices)
    _step_(flat, indices, update, steps)
    full_factor, full_coefficient = last_factor.clone(), lamb_coeff_freeze * last_factor
    full_factor[indices], full_coefficient[indices] = factor, coefficient
    return full_factor, full_coefficient


def predict_weights_(
    flat: FlatState,
    shared: Tensor,
    out: Tensor,
    momentum: Tensor,
    scaling: Tensor,
    limit: Tensor | None,
    coefficients: Tensor | None,
    active: Sequence[bool],
) -> None:
    """The delayed exchange's prediction (ALGORITHM.md, "Delayed exchange"), from the flat
    weights ``shared`` into the flat ``out`` (the flat weights, or a buffer of their size):
    ``out = p - lr c (clamp(buf / s, -limit, limit) / (sqrt(v) + eps) + wd p)``, ``p`` from
    ``shared``, for every active parameter (``out = p`` for the others and for an element
    whose move is not finite), ``buf`` this rank's scaled momentum before the exchange
    (``momentum``, left as it is), ``c`` the rule's coefficient (``None``: 1)."""
    indices = _active_indices(active)
    move = flat.scratch(0)[: flat.numel]
    move.copy_(momentum[: flat.numel])
    moves, weights = flat.views(move), flat.views(shared)
    torch._foreach_mul_(moves, list(scaling.reciprocal().unbind()))
    _limit_(move, limit)
    v, denom = flat.views(flat.exp_avg_sq), flat.views(flat.scratch(1))
    for group, idx in _by_group(flat, indices):
        _adam_direction(
            _pick(moves, idx),
            _pick(denom, idx),
            _pick(moves, idx),
            _pick(v, idx),
            _pick(weights, idx),
            group,
        )
    steps = -flat.segment_values(lambda g: g["lr"])[indices]
    if coefficients is not None:
        steps = steps * coefficients[indices]
    _scale_each(_pick(moves, indices), steps)
    move.masked_fill_(~torch.isfinite(move), 0)
    inactive = set(range(len(active))) - set(indices)
    torch.add(shared[: flat.numel], move, out=out[: flat.numel])
    for index in inactive:
        flat.view(out, index).copy_(flat.view(shared, index))


def onebit_adam_compressed_step_(
    flat: FlatState,
    packed: ExchangeResult,
    scratch: Tensor,
    scaling: Tensor,
    limit: Tensor | None,
    active: Sequence[bool],
) -> None:
    """A compression-stage 1-bit Adam step: ``m = clamp(decoded / s, -limit, limit)``;
    ``p <- p - lr (m / (sqrt(v) + eps) + wd p)`` with ``v`` frozen."""
    new = _decode_momentum(flat, packed, scaling, limit, scratch)
    _frozen_adam_update_(flat, new, _active_indices(active))


def adam_momentum_step_(flat: FlatState, grads: Sequence[Tensor], active: Sequence[bool]) -> None:
    """For every active parameter: ``m = b1 m + (1 - b1) g``;
    ``p <- p - lr (m / (sqrt(v) + eps) + wd p)``; ``v`` unchanged (0/1 Adam's steps that do
    not update the variance)."""
    m, v, p = flat.views(flat.exp_avg), flat.views(flat.exp_avg_sq), flat.weight_views()
    update, denom = flat.views(flat.scratch(0)), flat.views(flat.scratch(1))
    for group, idx in _by_group(flat, _active_indices(active)):
        beta1 = group["betas"][0]
        momentum = _pick(m, idx)
        torch._foreach_mul_(momentum, beta1)
        torch._foreach_add_(momentum, _pick(grads, idx), alpha=1 - beta1)
        direction = _pick(update, idx)
        _adam_direction(direction, _pick(denom, idx), momentum, _pick(v, idx), _pick(p, idx), group)
        torch._foreach_add_(_pick(p, idx), direction, alpha=-group["lr"])


def onebit_adam_per_tensor_step_(
    flat: FlatState,
    packed: ExchangeResult,
    exchanged: Tensor,
    limit: Tensor | None,
    active: Sequence[bool],
) -> None:
    """A compression-stage 1-bit Adam step with the momentum exchanged tensor by tensor
    (``packed``, decoded into ``exchanged``): ``m = clamp(exchanged, -limit, limit)``;
    ``p <- p - lr (m / (sqrt(v) + eps) + wd p)`` with ``v`` frozen."""
    packed.decode(exchanged)
    _limit_(exchanged[: flat.numel], limit)
    _frozen_adam_update_(flat, flat.views(exchanged), _active_indices(active))


def _frozen_adam_update_(flat: FlatState, new: list[Tensor], indices: list[int]) -> None:
    """``m = new``; ``p <- p - lr (m / (sqrt(v) + eps) + wd p)`` for the listed parameters
    (``new``, each parameter's view of a spent buffer, is overwritten)."""
    m, v, p = flat.views(flat.exp_avg), flat.views(flat.exp_avg_sq), flat.weight_views()
    denom = flat.views(flat.scratch(1))
    for group, idx in _by_group(flat, indices):
        torch._foreach_copy_(_pick(m, idx), _pick(new, idx))
        _adam_direction(
            _pick(new, idx), _pick(denom, idx), _pick(m, idx), _pick(v, idx), _pick(p, idx), group
        )
        torch._foreach_add_(_pick(p, idx), _pick(new, idx), alpha=-group["lr"])


# --------------------------------------------------------------------------- 0/1 Adam
def _denominators(flat: FlatState, idx: list[int], group: dict) -> list[Tensor]:
    """``d = sqrt(v) + eps`` of the listed parameters, in scratch buffer 1."""
    denom = _pick(flat.views(flat.scratch(1)), idx)
    torch._foreach_copy_(denom, _pick(flat.views(flat.exp_avg_sq), idx))
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, group["eps"])
    return denom


def accumulated_update(flat: FlatState, active: Sequence[bool], out: Tensor) -> Tensor:
    """``out_p = (p - p_synced) (sqrt(v) + eps)`` for every active parameter (zeros for the
    others): 0/1 Adam's update since the last synchronisation, in units of momentum."""
    indices = _active_indices(active)
    p, (synced, target) = flat.weight_views(), (flat.views(t) for t in (flat.synced_param, out))
    out.zero_()
    for group, idx in _by_group(flat, indices):
        delta = _pick(target, idx)
        torch._foreach_copy_(delta, _pick(p, idx))
        torch._foreach_sub_(delta, _pick(synced, idx))
        torch._foreach_mul_(delta, _denominators(flat, idx, group))
    return out


def synchronised_update_(
    flat: FlatState, exchanged: Tensor, active: Sequence[bool], lr_sum: Tensor
) -> None:
    """0/1 Adam's synchronisation with the exchanged accumulated update ``exchanged``
    (``d``-scaled), for every active parameter: ``m = -exchanged / lr_sum`` (0 where
    ``lr_sum = 0``); ``p_synced <- p_synced + exchanged / d``; ``p = p_synced``;
    ``lr_sum = 0``."""
    indices = _active_indices(active)
    m, synced, p = flat.views(flat.exp_avg), flat.views(flat.synced_param), flat.weight_views()
    delta = flat.views(exchanged)
    rebuild = momentum_rebuild(lr_sum)
    for group, idx in _by_group(flat, indices):
        torch._foreach_copy_(_pick(m, idx), _pick(delta, idx))
        _scale_each(_pick(m, idx), rebuild[idx])
        torch._foreach_div_(_pick(delta, idx), _denominators(flat, idx, group))
        torch._foreach_add_(_pick(synced, idx), _pick(delta, idx))
        torch._foreach_copy_(_pick(p, idx), _pick(synced, idx))
    lr_sum[indices] = 0


# --------------------------------------------------------------------------- the reference
REFERENCE = SimpleNamespace(
    lamb_step_=lamb_step_,
    adam_step_=adam_step_,
    scaled_momentum=scaled_momentum,
    adam_momentum_step_=adam_momentum_step_,
    onebit_lamb_compressed_step_=onebit_lamb_compressed_step_,
    onebit_adam_compressed_step_=onebit_adam_compressed_step_,
    onebit_adam_per_tensor_step_=onebit_adam_per_tensor_step_,
    accumulated_update=accumulated_update,
    synchronised_update_=synchronised_update_,
    predict_weights_=predict_weights_,
)
"""The torch reference as update kernels (:class:`onebit.kernels.UpdateKernels`)."""
