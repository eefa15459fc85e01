"""Parts a training recipe composes: objectives, trained models with their own engines, schedules, LoRA, and the shared setup (accelerator, denoiser, frozen components, exit protocol)."""
