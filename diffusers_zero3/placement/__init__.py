"""Frozen models and where they live: replicas, ZeRO-3 inference engines, offload, the frozen-output cache, the placement planner and its published configs, the parallel reward model."""
