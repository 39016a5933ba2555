"""Weights on transparent huge pages: small matrices copied into 2 MiB-aligned arenas that ask the kernel for huge
pages (madvise MADV_HUGEPAGE), as numpy already asks for its own allocations of 4 MiB and more.

Why: a weight stream through 4 KiB pages misses the TLB every 4 KiB. Measured on the 2-core machine (Intel Xeon,
THP "madvise"), 22 matrices of 2.4 MB (TinyLlama's q4_0 wo) one after another from memory: a plain read 22.8 GB/s
with each in its own numpy array (under numpy's threshold: 4 KiB pages), 29.4 GB/s on huge pages; fast.cpu.matmul,
whose software prefetches hide part of the misses, 27.1 -> 28.8 GB/s. TinyLlama's q4_0 attention matrices and
predictors are all under 4 MiB: its sparse q4_0 token ran 1.8 % faster (10.27 -> 10.08 ms, alternating).
"""

import mmap
import threading

import numpy as np

HUGE = 2 << 20  # an x86-64 huge page
NUMPY_ADVISES = 4 << 20  # numpy's allocations of at least this are advised already (numpy/_core/src/multiarray/alloc.c)
CHUNK = 32 << 20  # an arena's size: what it holds wastes at most NUMPY_ADVISES of it at its end
ALIGN = 64  # a cache line: each array starts on one


class Arena:
    """Bump allocation of byte ranges from anonymous private mappings advised for huge pages, one chunk at a time.
    A chunk is unmapped when the last array carved from it (and the arena, for the current one) lets it go. Safe to
    share between threads (a server loads its model on its engine thread)."""

    def __init__(self):
        self.chunk, self.used, self.lock = np.empty(0, np.uint8), 0, threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """nbytes uint8 at a cache-line boundary of a huge-page chunk."""
        with self.lock:
            if self.used + nbytes > self.chunk.size:
                self.chunk, self.used = huge_chunk(max(CHUNK, nbytes)), 0
            out = self.chunk[self.used:self.used + nbytes]
            self.used += -(-nbytes // ALIGN) * ALIGN
        return out


def huge_chunk(nbytes: int) -> np.ndarray:
    """nbytes uint8, 2 MiB-aligned, in a private anonymous mapping advised for huge pages where the OS has them
    (a shared anonymous mapping would follow shmem's huge-page setting instead, often 'never'); plain memory on a
    system without such mappings."""
    if not hasattr(mmap, "MAP_PRIVATE"):
        return np.empty(nbytes, np.uint8)
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
            pass
    buf = np.frombuffer(m, np.uint8)
    start = -buf.ctypes.data % HUGE
    return buf[start:start + nbytes]


ARENA = Arena()


def on_huge_pages(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` in the arena where numpy would not ask for huge pages itself (under 4 MiB), else
    `a` as it is (a large view of a file stays one: copying it would double what the model holds)."""
    if a.nbytes >= NUMPY_ADVISES or a.nbytes == 0:
        return a
    out = ARENA.take(a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out
