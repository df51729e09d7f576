"""DyNet baselines: each model written naturally per instance in DyNet.

Each ``bench.dynet_models.<name>`` module has ``build(task)`` (copies the torch
model's weights into a DyNet ParameterCollection), ``forward(dy_model, inputs)``
(one computation graph for the whole mini-batch, evaluated with a single forward
pass so that DyNet's autobatching sees every instance) and ``run(task)``, the two
together. Outputs are numpy arrays shaped like the torch model's outputs.

DyNet reads its configuration once, when it is first imported, so call
:func:`configure` before importing any of the model modules::

    from bench.dynet_models import configure
    configure(autobatch=1)
    from bench.dynet_models import treelstm
    outs = treelstm.run(task)
"""

from __future__ import annotations

import sys

# DyNet's values for ``autobatch`` (read by BatchedExecutionEngine in dynet/exec.cc):
# 0 no batching, 1 agenda-based, 2 depth-based, 3 agenda-based restricted to one depth
# at a time, >= 100 time strategies 1-3 on the first forward pass and keep the fastest.
STRATEGIES = {1: "agenda", 2: "depth"}
# Initial MB of DyNet's memory pools. DyNet grows them on demand (MV-RNN large at batch
# 64 needs ~1.5 GB) and writes all of the initial size at start-up: 2048 costs ~4 s.
DEFAULT_MEM = "512"


def configure(autobatch: int = 1, mem: str = DEFAULT_MEM) -> None:
    """Sets DyNet's autobatch strategy and memory; must run before DyNet is first imported."""
    import dynet_config

    if "dynet" in sys.modules:
        current = dynet_config.get() or {}
        if current.get("autobatch") != autobatch:
            raise RuntimeError(
                f"DyNet was already imported with autobatch={current.get('autobatch')}; "
                f"autobatch={autobatch} needs a fresh process"
            )
        return
    dynet_config.set(autobatch=autobatch, mem=mem, random_seed=1)


def available() -> bool:
    """True when the DyNet Python package (``dynet38``) is installed."""
    import importlib.util

    return (
        importlib.util.find_spec("dynet") is not None
        and importlib.util.find_spec("dynet_config") is not None
    )
