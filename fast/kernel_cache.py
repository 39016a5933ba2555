"""numba's on-disk cache for fast's kernels, stamped by every source that compiles into them.

numba keys a cached function by the hash of the one file that defines it, but a kernel of the fast.cpu package
compiles in its callees from the package's other files and the row operations of the fast.quant package: an edit
there (or a `git pull`) would keep running the old code. The locators here stamp each function of fast/ with the
hash of its own file and of `SOURCES` together, so that numba itself sees such a cache as stale and compiles again;
nothing is deleted and nothing is written beside numba's files.
`install` puts them first in numba's list of locators; they answer for fast/'s files only.
"""

import contextlib
import functools
import hashlib
import os

from numba.core import caching, event

HERE = os.path.dirname(os.path.abspath(__file__))
# compiled into fast.cpu's kernels: the kernels' package and the row operations of the fast.quant package
SOURCES = tuple(sorted(os.path.join(package, name) for package in ("cpu", "quant")
                       for name in os.listdir(os.path.join(HERE, package)) if name.endswith(".py")))


@functools.lru_cache(maxsize=None)
def stamp(py_file: str) -> str:
    """sha256 of py_file and SOURCES, in that order."""
    digest = hashlib.sha256()
    for path in (py_file, *(os.path.join(HERE, name) for name in SOURCES)):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class KernelSources:
    """A locator mixin: numba's own locator for a file of fast/, its stamp `stamp`."""

    def get_source_stamp(self):
        return stamp(os.path.abspath(self._py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        if not os.path.abspath(py_file).startswith(HERE + os.sep):
            return None
        return super().from_function(py_func, py_file)


class UserProvided(KernelSources, caching.UserProvidedCacheLocator):
    """NUMBA_CACHE_DIR, where the user set it."""


class InTree(KernelSources, caching.InTreeCacheLocator):
    """fast/__pycache__, where it is writable."""


class UserWide(KernelSources, caching.UserWideCacheLocator):
    """The user's cache folder (a read-only install)."""


def install() -> None:
    """Ask these locators first (numba's order: the user's folder, beside the file, the user's cache); before any
    `cache=True` kernel of fast/ is defined, since numba picks a function's locator then."""
    locators = caching.CacheImpl._locator_classes
    if UserProvided not in locators:
        locators[:0] = [UserProvided, InTree, UserWide]


@contextlib.contextmanager
def first_compile(callback):
    """Within the block, call callback() once, when numba starts to compile a kernel of fast/ that it found in no
    cache (its "numba:compile" event: loading a cached kernel raises none; numba's own typed-list helpers compile
    in every process, in a second or two, and are not counted)."""
    class First(event.Listener):
        fired = False

        def on_start(self, ev):
            code = getattr(getattr(ev.data["dispatcher"], "py_func", None), "__code__", None)
            if not self.fired and code is not None and os.path.abspath(code.co_filename).startswith(HERE + os.sep):
                self.fired = True
                callback()

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", First()):
        yield
