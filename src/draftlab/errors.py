"""The one user-error type: a mistake or a condition the user can act on, said in one line.

The CLI catches `UserError` once, prints its message as one line and exits with its
`exit_code` (2 for bad input; 1 for work that ran and failed, e.g. a training that diverged).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """One line: what is wrong, which key or file, what to do."""

    exit_code = 2


class RunFileError(UserError):
    """A run-folder file (draftlab.rundir) that is missing, partial or malformed."""
