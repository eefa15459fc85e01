"""The trainers behind the scripts: text-to-image (and video), DreamBooth, ControlNet, Diffusion-DPO."""
