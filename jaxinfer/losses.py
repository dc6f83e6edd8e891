"""Token losses shared by training and evaluation: cross entropy and distillation KL."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token next-token cross entropy, fused: logsumexp(logits) - logits[target].

    Args:
      logits: [B, S, V] float32.
      targets: [B, S] int.

    Returns:
      [B, S] float32, nats.
    """
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, S]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, S]
    return lse - picked


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats) of `logits [B, S, V]` against `targets [B, S]`."""
    return jnp.mean(token_cross_entropy(logits, targets))


def distill_kl(student_logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
    """Mean over positions of KL(teacher || student) of the next-token distributions.

    KL(p || q) = sum_v p_v (log p_v - log q_v), p = softmax(teacher), q = softmax(student): the
    forward KL, which covers every token the teacher may emit (what speculative acceptance rewards).

    Args:
      student_logits: [B, S, V] float32.
      teacher_logits: [B, S, V] float32 (no gradient flows into it).

    Returns:
      [] float32, nats.
    """
    teacher_logits = jax.lax.stop_gradient(teacher_logits)
    log_p = jax.nn.log_softmax(teacher_logits, axis=-1)  # [B, S, V]
    log_q = jax.nn.log_softmax(student_logits, axis=-1)  # [B, S, V]
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [B, S]
    return jnp.mean(kl)
