"""Generated batched kernels for acrobat, behind a narrow interface.

:mod:`acrobat_kernels.elementwise` fuses the gathers of a batch's operands into one
elementwise kernel (ACRoBat section 5.2), with torch, numba (CPU) and CUDA backends.
"""

from acrobat_kernels.elementwise import (
    OPS,
    OPS_TABLE,
    OpDef,
    Program,
    available_backends,
    cuda_source,
    lstm_cell_tail,
    numba_source,
    run,
)

__all__ = [
    "OPS",
    "OPS_TABLE",
    "OpDef",
    "Program",
    "available_backends",
    "cuda_source",
    "lstm_cell_tail",
    "numba_source",
    "run",
]
