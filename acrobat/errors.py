"""User-facing errors. Internal invariants use ``assert``; everything a user can cause
raises an :class:`AcrobatError` that names the op, the instance and the user's line."""

from __future__ import annotations

import os
import sys

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = None


def _is_internal(filename: str) -> bool:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        _TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
    filename = os.path.abspath(filename)
    return (
        filename.startswith(_PKG_DIR)
        or filename.startswith(_TORCH_DIR)
        or "greenlet" in filename
        or filename.startswith("<")
    )


def user_line(depth: int = 1) -> str:
    """The innermost stack frame outside acrobat and torch, as 'file:line in fn: code'."""
    return frame_line(sys._getframe(depth))


def user_frame(frame):
    """``frame`` or its nearest caller outside acrobat and torch (None: there is none)."""
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def frame_line(frame) -> str:
    """'file:line in fn: code' of ``frame`` or its nearest caller outside acrobat/torch."""
    frame = user_frame(frame)
    if frame is None:
        return "<unknown location>"
    import linecache

    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    return f"{where}: {code}" if code else where


class AcrobatError(RuntimeError):
    """An error in how acrobat was used (unsupported op, bad shapes, bad map inputs, ...)."""


class AcrobatWarning(UserWarning):
    """Something ran correctly but not batched the way the user likely meant."""


class UnsupportedOpError(AcrobatError, NotImplementedError):
    """A torch function acrobat cannot record on lazy tensors."""


class UnsupportedMethodError(UnsupportedOpError, AttributeError):
    """A torch.Tensor method acrobat cannot record (an AttributeError too, so ``hasattr``
    and ``getattr(x, name, default)`` keep working)."""


class ShapeError(AcrobatError, ValueError):
    """An op's operands do not fit together (raised at record time)."""


class InstanceIndexError(AcrobatError, IndexError):
    """An index out of range in one instance's batched work (the instance named)."""


class LazyValueError(AcrobatError):
    """A lazy tensor was used where its value cannot be produced (escaped its map, inside a
    block, or a demand that can never be satisfied)."""


class NoInstanceWork(LazyValueError):
    """A block's trace computes nothing from its per-instance inputs (for these arguments:
    an automatic block may run its code as written for this call alone)."""


def where(instance: int | None, line: str | None) -> str:
    parts = []
    if instance is not None:
        parts.append(f"instance {instance}")
    if line:
        parts.append(f"at {line}")
    return " ".join(parts)
