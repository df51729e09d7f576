"""Counters and timings of one ``f.map`` call (ACRoBat's Table 6 split)."""

from __future__ import annotations


class Stats:
    """``nodes`` recorded (``dead`` of them never executed: nothing could read them;
    ``shared``: nodes given the row of another node of their batch with the same operand
    rows, and loop elements whose hoisted part another equal element's row gave,
    config.DISTINCT_ROWS),
    ``batches`` executed, kernel ``launches`` (torch calls issued by
    batched rules, a block counting its inner ops), ``gathers`` (copies made to collect
    operands; views are free) and their bytes, fiber ``suspensions`` and ``flushes``, and
    times in seconds: ``t_record`` (running user code + recording the graph), ``t_schedule``
    (ordering batches), ``t_gather`` and ``t_kernel`` (executing), ``t_total``."""

    __slots__ = (
        "nodes",
        "batches",
        "launches",
        "gathers",
        "gather_bytes",
        "suspensions",
        "flushes",
        "instances",
        "t_record",
        "t_schedule",
        "t_gather",
        "t_kernel",
        "t_total",
        "by_op",
        "gathers_fused",
        "batches_lower_bound",
        "dead",
        "shared",
        "eager_loop",
    )

    def __init__(self):
        self.nodes = self.batches = self.launches = self.gathers = self.gather_bytes = 0
        self.gathers_fused = self.suspensions = self.flushes = self.instances = 0
        self.batches_lower_bound = 0  # computed only with config.VERIFY or DEBUG
        self.dead = 0  # recorded nodes nothing could read: not executed (config.PRUNE_DEAD)
        self.shared = 0  # nodes / loop elements given another's row (DISTINCT_ROWS)
        self.eager_loop = False  # the map ran as the eager loop (config.MAP_CHOICE)
        self.t_record = self.t_schedule = self.t_gather = self.t_kernel = self.t_total = 0.0
        self.by_op: dict[str, list[int]] = {}  # op name -> [batches, nodes]

    def batches_of(self, op_name: str) -> int:
        return self.by_op.get(op_name, (0, 0))[0]

    @property
    def us_per_node(self) -> float:
        """Graph construction + scheduling time per recorded node, in microseconds."""
        return 1e6 * (self.t_record + self.t_schedule) / max(self.nodes, 1)

    @property
    def nodes_per_batch(self) -> float:
        return self.nodes / max(self.batches, 1)

    def as_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__slots__}
        d["us_per_node"] = self.us_per_node
        d["nodes_per_batch"] = self.nodes_per_batch
        return d

    def __repr__(self) -> str:
        return (
            f"Stats(instances={self.instances}, nodes={self.nodes}, batches={self.batches}, "
            f"launches={self.launches}, gathers={self.gathers} ({self.gather_bytes / 1e6:.2f} MB), "
            f"suspensions={self.suspensions}, flushes={self.flushes}, "
            f"record={1e3 * self.t_record:.2f} ms, schedule={1e3 * self.t_schedule:.2f} ms, "
            f"gather={1e3 * self.t_gather:.2f} ms, kernels={1e3 * self.t_kernel:.2f} ms, "
            f"total={1e3 * self.t_total:.2f} ms, {self.us_per_node:.2f} us/node)"
        )
