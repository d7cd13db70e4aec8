"""Run one function of a test module in a new Python interpreter.

A test process has run many tests before, and some leave threads behind (engines, process groups,
pools). Code that behaves differently with other threads running (``reshard.forked`` does not fork then)
is checked in an interpreter whose only thread is its main one::

    def _check_it(): ...            # asserts; any error fails the test with its output
    def test_it():
        in_a_fresh_interpreter(__file__, "_check_it")
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def in_a_fresh_interpreter(module_file: str, function: str, *args, timeout: float = 300) -> str:
    """Run ``function(*args)`` of the module at ``module_file`` (``args``: literals) in a new interpreter
    and return its stdout; fail with its output if it raises, and stop it (its children too) after
    ``timeout`` seconds (a margin for a busy host: the checks take seconds)."""
    code = (f"import runpy, threading\nnames = runpy.run_path({module_file!r})\n"
            f"assert threading.active_count() == 1, threading.enumerate()\nnames[{function!r}](*{args!r})\n")
    script = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=os.path.dirname(os.path.abspath(module_file)), start_new_session=True)
    try:
        out, err = script.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(script.pid, signal.SIGKILL)  # the interpreter and any child it forked
        out, err = script.communicate()
        raise AssertionError(f"{function} did not finish in {timeout} s\n{out}\n{err}") from None
    if script.returncode != 0:
        raise AssertionError(f"{function} failed (status {script.returncode}):\n{out}\n{err}")
    return out
