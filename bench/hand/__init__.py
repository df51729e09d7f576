"""Hand-batched PyTorch baselines: ``run(task)`` gives the same outputs as ``run_eager(task)``."""
