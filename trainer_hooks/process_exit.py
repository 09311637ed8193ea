"""End a rank's process with the exit code it means, whatever torch's native threads are still doing.

A gloo process group's worker threads (``pt_gloo_runloop``) destroy each collective's work object after they
marked it complete, and the main thread may be far ahead by then: a rank whose last collective just finished can
return from its ``main`` and begin the interpreter's finalization before that thread is scheduled again (a busy
machine, a rank descheduled while its peers time out). The work holds the collective's tensors; one whose Python
object is gone is freed through the interpreter (``decref_pyobject`` takes the GIL), and a thread that asks for the
GIL while the interpreter finalizes is ended by ``pthread_exit``. Its forced unwind meets the work's ``noexcept``
destructor and the process dies of SIGABRT, ``terminate called without an active exception``, after a run that
succeeded (docs/crash.md has the stack, from a core dump).

So a rank ends as a normal exit would, without the finalization: its ``atexit`` handlers run, its streams and logs
are flushed, and ``os._exit`` ends it with its code. Nothing left for the finalization to do matters to a rank
whose work is done (its checkpoints awaited, its monitor closed, its process group destroyed).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

#: the exit code of a rank whose ``main`` raised (Python's own for an uncaught exception)
EXIT_ERROR = 1


def exit_code_of(value: object) -> int:
    """The process exit code ``sys.exit(value)`` would give: None is 0, an int itself, anything else printed and 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return EXIT_ERROR


def exit_process(code: int) -> NoReturn:
    """Run the ``atexit`` handlers, flush the logs and the standard streams, and end the process with ``code`` at
    once (``os._exit``): torch's native threads cannot turn it into a SIGABRT."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or replaced: nothing to flush
                stream.flush()
        os._exit(code)


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """``sys.exit(main())`` for a rank: ``main``'s return value (or ``SystemExit``) is the exit code, an exception
    is printed as Python would and exits 1; then ``exit_process``."""
    try:
        code = exit_code_of(main())
    except SystemExit as exc:
        code = exit_code_of(exc.code)
    except BaseException:
        traceback.print_exc()
        code = EXIT_ERROR
    exit_process(code)
