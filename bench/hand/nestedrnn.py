"""Hand-batched NestedRNN: every instance keeps its own loop counters, all advance together.

Instances are not synchronised at outer-step boundaries: at each tick every
instance still in an inner loop takes one inner step (one GEMM for all of them,
finished rows masked), then the instances whose inner loop just ended take their
GRU step together and start their next inner loop. The inner cell's input part
``W_x x + b`` is the same at every inner step of an instance, so it is computed
once, up front.
"""

from __future__ import annotations

import torch

from models.common import Task
from models.nestedrnn import Instance, NestedRNN


def gru_rows(model: NestedRNN, r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Batched :func:`models.nestedrnn.gru_cell` on (rows, hidden) inputs."""
    reset, update = torch.sigmoid(model.gates(torch.cat([r, g], dim=1))).chunk(2, dim=1)
    cand = torch.tanh(model.cand_x(r) + reset * model.cand_h(g))
    return cand + update * (g - cand)


@torch.no_grad()
def run(task: Task) -> list[torch.Tensor]:
    """[final outer state] for ``task.inputs``, equal to the eager NestedRNN's outputs."""
    model: NestedRNN = task.model
    instances: list[Instance] = task.inputs
    batch, hidden = len(instances), model.hidden
    outer_counts = torch.tensor([len(inst.trips) for inst in instances])
    trips = torch.zeros(batch, int(outer_counts.max()) + 1, dtype=torch.long)  # 0-padded
    for row, inst in enumerate(instances):
        trips[row, : len(inst.trips)] = torch.tensor(inst.trips)

    w_x, w_r = model.inner.weight[:, :hidden], model.inner.weight[:, hidden:]
    x_part = torch.addmm(model.inner.bias, torch.stack([inst.x for inst in instances]), w_x.t())
    w_r_t = w_r.t().contiguous()

    g = torch.zeros(batch, hidden)
    r = g.clone()
    outer = torch.zeros(batch, dtype=torch.long)
    remaining = trips[:, 0].clone()
    active = outer < outer_counts
    while bool(active.any()):
        inner = remaining > 0  # finished instances have remaining == 0
        r = torch.where(inner[:, None], torch.tanh(torch.addmm(x_part, r, w_r_t)), r)
        remaining -= inner.long()
        ending = (active & (remaining == 0)).nonzero().squeeze(1)
        if len(ending):
            g_new = gru_rows(model, r[ending], g[ending])
            g[ending] = g_new
            r[ending] = g_new  # the next inner loop starts from the outer state
            outer[ending] += 1
            remaining[ending] = trips[ending, outer[ending]]
            active = outer < outer_counts
    return list(g.unbind(0))
