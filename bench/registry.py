"""Models known to the benchmark, by name -> module paths.

Each model module (``models.<name>``) exposes ``make_task(size, batch, seed=0, blocks=True)``.
Optional baselines: ``bench.hand.<name>.run(task)`` (hand-batched PyTorch) and
``bench.dynet_models.<name>.run(task)`` (DyNet, natural per-instance code).
A model whose module does not import yet is skipped by the harness.
"""

MODELS = {
    "treelstm": "models.treelstm",
    "mvrnn": "models.mvrnn",
    "birnn": "models.birnn",
    "nestedrnn": "models.nestedrnn",
    "drnn": "models.drnn",
    "berxit": "models.berxit",
    "stackrnn": "models.stackrnn",
}
