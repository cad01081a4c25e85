"""``failslow demo``: the main job (a real DeepSpeed job, a fail-slow injected from outside,
found and mitigated) and the detection-only DDP demo."""
