"""``python _pdeathsig.py SIG PARENT_PID CMD ARGS...``: set PR_SET_PDEATHSIG to SIG,
then exec CMD (what ``setpriv --pdeathsig`` does, where setpriv is missing); exits
at once if PARENT_PID already died before the signal was set. Used by _proc.popen."""

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    sig, parent, *argv = sys.argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):
        os._exit(1)  # the parent is already gone: its death signal will never come
    os.execvp(argv[0], argv)


main()
