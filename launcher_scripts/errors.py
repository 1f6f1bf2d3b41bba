"""Errors the user can act on. Their message is printed as one line, without a traceback."""


class LauncherError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""

    exit_code = 2


class ConfigError(LauncherError):
    """The composed configuration is wrong: a key, a value or a missing file."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}. {fix}")


class RecipeError(ConfigError):
    """A ConfigError written as one sentence: "<key>: <problem and fix>"."""

    def __init__(self, message: str) -> None:
        key, _, problem = message.partition(": ")
        LauncherError.__init__(self, message)
        self.key, self.problem, self.fix = key, problem, ""


class JobError(RuntimeError):
    """A problem with a job program's inputs or settings, reported as one line, not a
    traceback (the job programs' counterpart of ConfigError)."""


class HfImportError(ValueError):
    """A Hugging Face model that cannot be imported exactly (a field, a tensor, a file), as one
    line naming it."""
