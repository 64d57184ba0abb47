"""Errors that mean "the user asked for something that cannot be done"; the CLI prints them as one sentence."""


class UserError(Exception):
    """Base of every error whose message is meant for the user, without a traceback."""


class UnknownNameError(UserError, ValueError):
    """A name that no registry knows (loss mode, estimator, reward, engine, ...)."""
