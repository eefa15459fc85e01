"""Rewards for online RL of diffusion models: the command-line specs (``specs``), the
built-in reward models (``builtin``: PickScore, CLIPScore, the LAION aesthetic predictor, a
VLM judge; ``hps``: HPSv2; ``imagereward``: ImageReward), their tensor preprocessing (``images``) and the weighted sum over them
(``registry``), each reward a ``placement.rewards.ParallelReward``; group-wise rewards, which score
a prompt's group gathered from every rank (``groupwise``; Pref-GRPO's pairwise win rate with the
``pairwise_judge`` built-in); clips (``ClipScoring``): an image reward scores some of their
frames, a judge of whole clips (``unifiedreward_video``; ``videos``) sees them whole.

Images are float tensors ``[B, 3, H, W]`` in ``[0, 1]`` on the accelerator's device; clips
``[B, F, 3, H, W]``.
"""

from .registry import ClipScoring, WeightedRewards, load_rewards
from .specs import RewardSpec, parse_reward_specs

__all__ = ["ClipScoring", "RewardSpec", "WeightedRewards", "load_rewards", "parse_reward_specs"]
