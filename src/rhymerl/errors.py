"""Bad input from the user, as opposed to a bug: the one exception family the command line turns into a
single line (`rhymerl: error: <message>`, exit code 2) instead of a traceback.

Raise `UserError` (or a subclass) where an input is read, with a message that names the file, key or field
and says what to do. It subclasses ValueError so that callers (and tests) that catch ValueError keep working;
a plain ValueError is not a UserError and still shows its traceback: it may be a bug.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """An input (config, data, model, reward module, checkpoint, run directory, option) that cannot be used;
    the message names it and says what to do."""
