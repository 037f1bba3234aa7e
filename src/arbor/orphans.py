"""Child processes that die with their parent, however the parent dies.

A child started in its own session (so that its whole process group can be signalled) is out of reach of a
signal sent to its parent's group, and a parent killed with SIGKILL runs no cleanup. Asking the kernel to
SIGTERM the child when its parent exits (Linux's PR_SET_PDEATHSIG, set between fork and exec) covers both: the
launcher's children (arbor.launch.process) and the vLLM server behind arbor's proxy (arbor.inference.vllm.server)
never outlive the process that started them. The signal follows the thread that forked the child, so start
children from the main thread. Elsewhere than Linux the callers' own shutdown paths still apply.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # no libc.so.6: the caller's own shutdown path still applies


def die_with_parent() -> Callable[[], None] | None:
    """`preexec_fn` for `subprocess.Popen`: the child gets SIGTERM when its parent exits (None off Linux)."""
    return _die_with_parent if sys.platform == "linux" else None
