"""What the harness's fork server imports once, so that a test's ranks start without importing
it again (``distributed_harness.run_on_ranks``): about 5 s a rank on this machine kind, for
each of the ~35 multi-rank tests. Every rank is still a new process forked from this state.
"""

import accelerate  # noqa: F401
import deepspeed  # noqa: F401
import deepspeed.runtime.engine  # noqa: F401
import deepspeed.runtime.zero.partition_parameters  # noqa: F401
import deepspeed.runtime.zero.stage3  # noqa: F401
import peft  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
from diffusers import (  # noqa: F401
    AutoencoderKL,
    AutoencoderKLWan,
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
)
from transformers import (  # noqa: F401
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5EncoderModel,
)

import diffusers_zero3.placement.frozen  # noqa: F401
import diffusers_zero3.runtime.zero3  # noqa: F401
import diffusers_zero3.state.ema  # noqa: F401
import diffusers_zero3.state.pretrained  # noqa: F401
import diffusers_zero3.testing  # noqa: F401
import diffusers_zero3.training.parts  # noqa: F401
