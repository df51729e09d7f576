"""Online choice among equivalent implementations (after Astra, online and
work-conserving): for each key (an op's signature and a batch-size bucket) the first calls
run the candidates in turn on the REAL work, timing each (per row, where the caller says
how many a call has); once every candidate has ``TRIALS`` samples, the fastest median
wins and is used from then on. Every trial computes the real result, so exploring costs
only the slower candidates' extra time.

Decisions live in memory per process; with ``config.CHOICE_CACHE`` set to a file path they
are also saved and reloaded, keyed by device, torch version and the key (only keys made of
plain values — names, shapes, dtypes — are saved).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from acrobat import config

TRIALS = 3


def bucket(n: int) -> int:
    """Batch sizes in one power-of-two bucket share a decision."""
    return 1 << max(n - 1, 0).bit_length()


def _stable(key) -> bool:
    if isinstance(key, (str, int, float, bool)) or key is None:
        return True
    if isinstance(key, (torch.dtype, torch.Size)):
        return True
    if isinstance(key, tuple):
        return all(_stable(k) for k in key)
    return False


class Chooser:
    def __init__(self, trials: int = TRIALS, warmup: int = 1):
        self.trials = trials
        self.warmup = warmup  # untimed first runs per variant (JIT compiles, caches)
        self.decided: dict = {}
        self.samples: dict = {}
        self._loaded_from: str | None = None
        self.saved: dict = {}

    def run(
        self,
        key,
        variants: dict[str, Callable],
        device: torch.device | None = None,
        work: int | None = None,
    ):
        """Run the chosen (or next trial) variant for ``key``; returns its result.
        ``work``: the size of this call within its key's bucket (a GEMM's rows): trials
        are compared per unit of it. A bucket spans up to 2x in rows (65-128), and raw
        times let a variant win because its trials met the bucket's smaller batches."""
        name = self.decided.get(key)
        if name is None and config.CHOICE_CACHE and _stable(key):
            saved = self.lookup_saved(key, device)
            if saved in variants:
                name = self.decided[key] = saved
        if name is not None:
            return variants[name]()
        samples = self.samples.get(key)
        if samples is None:
            samples = self.samples[key] = {v: [0, []] for v in variants}  # [warm-ups, times]
        name = min(samples, key=lambda v: samples[v][0] + len(samples[v][1]))
        entry = samples[name]
        if entry[0] < self.warmup:  # untimed: JIT compiles and cold caches don't count
            entry[0] += 1
            return variants[name]()
        sync = device is not None and device.type == "cuda"
        if sync:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = variants[name]()
        if sync:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
        entry[1].append(elapsed / work if work else elapsed)
        if all(len(times) >= self.trials for _, times in samples.values()):
            best = min(samples, key=lambda v: statistics.median(samples[v][1]))
            self.decided[key] = best
            del self.samples[key]
            self._maybe_save(key, best, device)
        return out

    # ---- optional disk cache -----------------------------------------------------
    @staticmethod
    def _disk_key(key, device) -> str:
        dev = str(device) if device is not None else "cpu"
        return json.dumps([dev, torch.__version__, repr(key)])

    def _maybe_load(self) -> None:
        path = config.CHOICE_CACHE
        if not path or self._loaded_from == path or not os.path.exists(path):
            return
        self._loaded_from = path
        try:
            with open(path) as f:
                self.saved = json.load(f)
        except (OSError, ValueError):
            self.saved = {}

    def _maybe_save(self, key, best: str, device) -> None:
        path = config.CHOICE_CACHE
        if not path or not _stable(key):
            return
        saved = getattr(self, "saved", {})
        saved[self._disk_key(key, device)] = best
        self.saved = saved
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(saved, f)
        os.replace(tmp, path)

    def lookup_saved(self, key, device) -> str | None:
        self._maybe_load()
        return getattr(self, "saved", {}).get(self._disk_key(key, device))


CHOOSER = Chooser()
