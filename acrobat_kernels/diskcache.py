"""numba's disk cache for this package's kernels, stamped with every kernel file.

numba keys a cached function on its own bytecode and on a stamp of the file that defines
it, not on the functions it calls or inlines from other files: the linear loop
(acrobat_kernels/loops.py) calls the product in gemm.py and the ``tanh`` of vecmath.py,
so with numba's stamp an edit of vecmath.py would leave a stale loop in the cache. The
locators here give every function defined in this package one stamp, the hash of all its
``.py`` files (:func:`sources_stamp`): an edit of any of them invalidates every cached
kernel, and nothing else does. :func:`install` puts them ahead of numba's own (once per
process); functions of other files keep numba's behaviour.

numba's own version and the CPU are part of its cache keys already.
"""

from __future__ import annotations

import functools
import hashlib
import os

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def _stamp_of(directory: str, files: tuple) -> str:
    digest = hashlib.sha256()
    for name, _, _ in files:
        digest.update(name.encode() + b"\0")
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()


def sources_stamp(directory: str = HERE) -> str:
    """The hash of the names and contents of the ``.py`` files in ``directory`` (re-read
    when a file's size or modification time changes)."""
    files = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".py"):
            st = os.stat(os.path.join(directory, name))
            files.append((name, st.st_mtime_ns, st.st_size))
    return _stamp_of(directory, tuple(files))


_installed: bool | None = None  # once tried: whether the locators are in place


def install() -> bool:
    """Let numba cache this package's functions under :func:`sources_stamp` (each of
    numba's file-backed locators gets a twin that applies to this package's files only and
    stamps them so; the twins are tried first, in numba's order). False where this numba
    has no such hook: the package's kernels are then compiled without the cache."""
    global _installed
    if _installed is not None:
        return _installed
    from numba.core import caching

    _installed = False
    impl = cache_impl()
    bases: list = [getattr(caching, name, None) for name in _BASES]
    if impl is None or None in bases or not isinstance(impl.__dict__.get("_locator_classes"), list):
        return False
    twins = []
    for base in bases:

        class Twin(base):  # type: ignore[valid-type, misc]
            def get_source_stamp(self):
                return sources_stamp()

            @classmethod
            def from_function(cls, py_func, py_file):
                if os.path.dirname(os.path.abspath(py_file)) != HERE:
                    return None
                return super().from_function(py_func, py_file)

        Twin.__name__ = Twin.__qualname__ = "Acrobat" + base.__name__
        twins.append(Twin)
    impl._locator_classes[:0] = twins
    _installed = True
    return True


#: numba's file-backed locators, in its order: NUMBA_CACHE_DIR, ``__pycache__`` beside the
#: file, the user's cache directory.
_BASES = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")


def cache_impl():
    """numba's class whose ``_locator_classes`` every cache consults (``_CacheImpl`` in
    older releases), or None."""
    from numba.core import caching

    for name in ("CacheImpl", "_CacheImpl"):
        impl = getattr(caching, name, None)
        if impl is not None:
            return impl
    return None


def compiled(make, fn):
    """``make(cache=True)(fn)``: ``fn`` compiled by the numba decorator ``make`` returns,
    with the disk cache under :func:`sources_stamp`; without it where this numba has no
    hook (:func:`install`) or no cache location can be written (numba raises RuntimeError:
    no locator)."""
    if install():
        try:
            return make(cache=True)(fn)
        except RuntimeError:
            pass
    return make(cache=False)(fn)
