"""The optax chain from `[optimizer]`: global-norm clip, then AdamW on a warmup+decay schedule."""

from __future__ import annotations

import jax
import optax

from jobspec.run_config import OptimizerConfig


def build_schedule(cfg: OptimizerConfig, decay_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to lr, then decay to lr * min_lr_ratio at `decay_steps` (held after)."""
    s = cfg.schedule
    peak, floor = cfg.lr, cfg.lr * s.min_lr_ratio
    warmup = min(s.warmup_steps, decay_steps)
    if s.kind == "constant":
        after = optax.constant_schedule(peak)
    elif s.kind == "cosine":
        after = optax.cosine_decay_schedule(
            peak, max(decay_steps - warmup, 1), alpha=s.min_lr_ratio
        )
    else:
        after = optax.linear_schedule(peak, floor, max(decay_steps - warmup, 1))
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _decay_mask(params):
    # Norm scales (1-D) are not decayed; matrices, the embedding included, are.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(
    cfg: OptimizerConfig, decay_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = build_schedule(cfg, decay_steps)
    parts = []
    if cfg.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        )
    )
    return optax.chain(*parts), schedule
