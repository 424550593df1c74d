"""Optimizer and learning-rate schedule of a trained role (actor or critic), with verl's keys.

`optax.chain(clip_by_global_norm(grad_clip), adamw)`, the AdamW learning rate injected as a
hyper-parameter so the schedule advances once per *training step* (verl steps its LR scheduler
once per `update_actor` call, not once per mini-batch). The schedule's value lives in the
optimizer state, so it is checkpointed and restored with it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`<role>.optim.*` and `<role>.grad_clip`, resolved to step counts."""

    lr: float
    warmup_steps: int
    total_steps: int
    warmup_style: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0

    @classmethod
    def from_config(cls, optim, grad_clip: float, total_steps: int) -> OptimConfig:
        """From a `<role>.optim` ConfigDict; `total_steps` is used when its own is -1.

        Warmup steps: `lr_warmup_steps` if > 0, else int(lr_warmup_steps_ratio × total).
        """
        total = optim.total_training_steps if optim.total_training_steps > 0 else total_steps
        warmup = optim.lr_warmup_steps
        if warmup <= 0:
            warmup = int(optim.lr_warmup_steps_ratio * total)
        b1, b2 = optim.betas
        return cls(
            lr=float(optim.lr),
            warmup_steps=int(warmup),
            total_steps=int(total),
            warmup_style=optim.warmup_style,
            min_lr_ratio=float(optim.min_lr_ratio),
            weight_decay=float(optim.weight_decay),
            b1=float(b1),
            b2=float(b2),
            grad_clip=float(grad_clip),
        )


def learning_rate(config: OptimConfig, step: jax.Array) -> jax.Array:
    """LR at training step `step` (0-based), float32.

    Warmup: lr · step / warmup (0 at step 0, as HF's `get_*_schedule_with_warmup` that verl uses).
    Then constant, or cosine from lr down to lr · min_lr_ratio at `total_steps`.
    """
    step = jnp.asarray(step, jnp.float32)
    warm = jnp.float32(max(config.warmup_steps, 1))
    warmup_factor = jnp.where(step < config.warmup_steps, step / warm, 1.0)
    if config.warmup_style == "cosine":
        span = max(config.total_steps - config.warmup_steps, 1)
        progress = jnp.clip((step - config.warmup_steps) / span, 0.0, 1.0)
        cosine = 0.5 * (1.0 + jnp.cos(math.pi * progress))
        decay = config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine
        factor = jnp.where(step < config.warmup_steps, warmup_factor, decay)
    else:
        factor = warmup_factor
    return (config.lr * factor).astype(jnp.float32)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW whose `learning_rate` is set by `set_learning_rate`."""
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=config.lr, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay
    )
    return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw)


def set_learning_rate(opt_state, lr: jax.Array):
    """The optimizer state of `make_optimizer` with AdamW's learning rate replaced by `lr`."""
    clip_state, adamw_state = opt_state
    hyper = dict(adamw_state.hyperparams, learning_rate=jnp.asarray(lr, jnp.float32))
    return clip_state, adamw_state._replace(hyperparams=hyper)
