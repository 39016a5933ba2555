"""Ctrl-C ends every CLI with one line and exit 130, wherever it lands (`python -m`, as users run them)."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT

# A command under `user_errors` whose Ctrl-C lands where CPython handles it oddly: inside a string exec (as in a
# dataclass's construction during an import), or in a weakref callback (where it cannot be raised).
COMMAND = '''
import signal, sys, time, weakref
from ref.common.errors import ctrl_c_quits_while_starting

ctrl_c_quits_while_starting(__name__)
if sys.argv[1] == "starting":  # as if during the imports
    signal.raise_signal(signal.SIGINT)
from ref.common.cli import user_errors

class Thing:
    pass

def lost(_):
    raise KeyboardInterrupt

@user_errors
def main():
    if sys.argv[1] == "exec":
        exec("raise KeyboardInterrupt", {})
    elif sys.argv[1] == "body":  # the body's cleanups run: Ctrl-C is a KeyboardInterrupt again
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            print("cleaned up")
    elif sys.argv[1] == "term":  # SIGTERM too: the cleanups run, then exit 143
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            print("cleaned up")
    else:
        thing = Thing()
        keep = weakref.ref(thing, lost)
        del thing
        deadline = time.monotonic() + 30  # the re-raised interrupt comes from a thread: as soon as it runs
        while time.monotonic() < deadline:
            pass
    print("finished")

main()
'''


@pytest.mark.parametrize("where, out", [("starting", ""), ("body", "cleaned up\n"), ("exec", ""), ("weakref", "")])
def test_ctrl_c_is_exit_130_wherever_it_lands(tmp_path, where, out):
    (tmp_path / "command.py").write_text(COMMAND)
    r = subprocess.run([sys.executable, "-m", "command", where], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": ""}, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (130, out, "\ninterrupted\n")


def test_sigterm_runs_the_cleanups_and_exits_143(tmp_path):
    (tmp_path / "command.py").write_text(COMMAND)
    r = subprocess.run([sys.executable, "-m", "command", "term"], cwd=tmp_path, capture_output=True, text=True,
                       env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": ""}, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (143, "cleaned up\n", "terminated\n")
