import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import acrobat

# Deterministic property tests in CI; `HYPOTHESIS_PROFILE=dev` explores more.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _verify_graph():
    """Every test runs with the graph verifier on (graph.lint at each flush), without
    fused kernels (each new block program would compile one; tests/test_fusion.py runs
    the fused paths explicitly), and with every map batched: the online choice of the
    eager loop (config.MAP_CHOICE) would run some of a test's later maps as the eager
    loop; tests/test_map_choice.py runs it explicitly."""
    with acrobat.config.override(VERIFY=True, KERNEL_BACKEND="off", MAP_CHOICE=False):
        yield
