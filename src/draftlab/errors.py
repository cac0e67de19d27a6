"""The one user-error type: a mistake or a condition the user can act on, said in one line.

Every error draftlab means a user to read derives from `UserError`: params (`ParamsError`), a
sweep space (`SpaceError`), an input record (`RecordError`), a run-folder file (`RunFileError`),
a missing stage input (`MissingInput`), this host's state (`HostError`: a folder in use, a full
disk, a port taken), and work that ran and failed (`ServingError`, `ExtractFailed`,
`TrainingFailed`, exit 1). The CLI catches `UserError` once (draftlab.cli), prints its message
as one line and exits with its `exit_code`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """One line: what is wrong, which key or file, what to do."""

    exit_code = 2


class RunFileError(UserError):
    """A run-folder file (draftlab.rundir) that is missing, partial or malformed."""


class MissingInput(UserError, FileNotFoundError):
    """A stage's input is not there yet; the message names the command that makes it."""


class HostError(UserError):
    """This host's state stops the work: a run folder another process holds, too little free
    disk, a port already taken. Nothing in params is wrong; the message says what to free."""
