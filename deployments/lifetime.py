"""A child process that ends with its parent (Linux ``prctl(PR_SET_PDEATHSIG)``).

For the processes we start or exec that would otherwise outlive a parent killed
without a chance to stop them (SIGKILL, the OOM killer, a lost node): the local
cluster's head under ``dsv4-serve run`` (``deployments.local.cluster``) and HAProxy
under ``dsv4-haproxy`` (``deployments.doors.haproxy``). The signal follows the parent
*thread* that started the child, so the parent must start it from a thread that lives
as long as the child should. Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """From now on this process gets ``signum`` when ``parent`` (our parent, by pid)
    dies; it is sent at once if ``parent`` already died (we were re-parented before
    the call took effect). Kept across ``exec``."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def preexec_die_with_parent(parent: int,
                            signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``subprocess.Popen`` ``preexec_fn`` doing ``die_with_parent`` in the child;
    None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return lambda: die_with_parent(parent, signum)
