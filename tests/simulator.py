"""A fix for numba-cuda's CUDA simulator that the GPU tests run under (numba-cuda 0.30.4).

The simulator runs each CUDA thread as a Python thread, and `cuda.shared.array` hands a block's threads one array,
allocated by the first to ask: it looks the array up by the caller's file and line, and stores a new one when none is
there, without a lock. A thread preempted between the lookup and the store lets another allocate a second array: the
block's threads then write to two, and its reduction (fast.gpu.block_reduce) sums half of them. The GPU golden test
failed so, once in about a thousand runs (relative error 0.99); preemption there is likelier at the 0.1 ms switch
interval the tests set (tests/conftest.py). Forcing a switch inside that window reproduces it (2 wrong blocks in 20
launches of 64); `lock_shared_arrays` makes lookup and store one step.
"""

import sys
import threading
import traceback

import numpy as np


def lock_shared_arrays() -> None:
    """Replace the simulator's FakeCUDAShared.array with the same allocation under a lock."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    real, lock = kernelapi.FakeCUDAShared.array, threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # refused, or dynamic shared memory: no lookup, no race
            return real(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[0])[:2]  # (file, line), as the simulator keys
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                found = self._allocations[caller] = np.empty(shape, dtype)
        return found

    kernelapi.FakeCUDAShared.array = array
