"""User-facing errors: one line, naming the file or flag at fault; and Ctrl-C, which is an exit, not a traceback.

Nothing here imports numpy or numba: `python -m fast.run` catches a Ctrl-C during those imports with it.
"""

import _thread
import contextlib
import os
import signal
import sys


class UserError(ValueError):
    """Bad input from the user (a file, a flag): the CLIs print the message alone and exit 1."""


class Terminated(BaseException):
    """SIGTERM, raised where the program is (`terminate`), so that its cleanups run as for a Ctrl-C."""


def terminate(signum=None, frame=None):
    raise Terminated()


_program = False  # set by ctrl_c_quits_while_starting: this process runs a CLI as its program


def quit_on_ctrl_c(signum=None, frame=None):
    """SIGINT handler for a CLI's start (its imports, its flags), which holds nothing to clean up: say 'interrupted'
    and exit 130 at once. `user_errors` hands Ctrl-C back to Python as the command's body starts."""
    os.write(2, b"\ninterrupted\n")
    os._exit(130)


def ctrl_c_quits_while_starting(module_name: str):
    """First line of a CLI module, given its `__name__`: run as the program, a Ctrl-C during its imports (numba's
    take a second or more) exits 130 at once instead of printing a traceback from inside them."""
    global _program
    if module_name == "__main__":
        _program = True
        signal.signal(signal.SIGINT, quit_on_ctrl_c)


def exit_interrupted():
    """Say 'interrupted' on stderr and exit 130, as a shell does for a Ctrl-C."""
    if _program:
        # The body's cleanups have run by now; the interpreter's finalisation has not, and a Ctrl-C that landed
        # while llvmlite built an object leaves one half-made, whose finaliser then crashes (SIGSEGV) or prints a
        # traceback. A program leaves without finalising, as quit_on_ctrl_c does.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        quit_on_ctrl_c()
    # Otherwise (a command's main called in-process, or a CLI without the start handler): CPython marks a
    # KeyboardInterrupt that leaves a string exec (dataclasses and namedtuple build their methods with one, so an
    # import is full of them) as unhandled even when it is caught, and at the end of `python -m` it then kills
    # itself with SIGINT instead of exiting 130. Every string exec clears that mark as it starts.
    exec("pass", {})
    sys.stderr.write("\ninterrupted\n")
    sys.exit(130)


@contextlib.contextmanager
def lost_interrupts_raised():
    """A Ctrl-C that lands where Python cannot raise it (a weakref or __del__ callback: it would be printed with a
    traceback and dropped) interrupts the main thread again, so that it ends the command like any other."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            # From another thread: called here, it would raise inside this hook, which cannot raise either
            _thread.start_new_thread(_thread.interrupt_main, ())
        else:
            previous(unraisable)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous

