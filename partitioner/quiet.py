"""Solver output kept off the user's terminal (the MILP search and the cost model's bound LP both solve)."""
import os
import sys


class quiet_stdout:
    """HiGHS prints its banner from C++ on file descriptor 1, past msg=False: silence the fd while solving."""

    def __enter__(self):
        sys.stdout.flush()
        self.saved = os.dup(1)
        self.null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(self.null, 1)

    def __exit__(self, *exc):
        os.dup2(self.saved, 1)
        os.close(self.saved)
        os.close(self.null)
