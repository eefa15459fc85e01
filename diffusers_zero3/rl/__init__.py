"""The numerics of online RL for flow-matching models (Flow-GRPO, DiffusionNFT): the SDE step and
its log-probability, group-relative advantages (also across ranks), which samples each rank
draws, and the losses. Pure functions of tensors: no trainer, no model."""

from .advantages import (
    gather_group_advantages,
    gather_group_reward_stats,
    group_advantages,
    group_reward_stats,
)
from .groups import group_assignment, samples_per_rank
from .losses import NftSettings, grpo_loss, guard_log_ratio, nft_loss, nft_optimality, sde_kl
from .schedules import (
    kept_sample_weight,
    nft_old_decay,
    reference_ema_decay,
    reference_ema_updates,
    sde_window,
    trained_timestep_indices,
)
from .sde import sde_step_with_logprob

__all__ = [
    "gather_group_advantages",
    "gather_group_reward_stats",
    "group_advantages",
    "group_reward_stats",
    "group_assignment",
    "grpo_loss",
    "guard_log_ratio",
    "kept_sample_weight",
    "NftSettings",
    "nft_loss",
    "nft_old_decay",
    "nft_optimality",
    "reference_ema_decay",
    "reference_ema_updates",
    "samples_per_rank",
    "sde_kl",
    "sde_step_with_logprob",
    "sde_window",
    "trained_timestep_indices",
]
