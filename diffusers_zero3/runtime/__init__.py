"""The processes and DeepSpeed: the accelerator, torch.distributed helpers, ZeRO-3 helpers (zero.Init off, gathered parameters, detection), DeepSpeed configs, launching, lockstep checks, memory."""
