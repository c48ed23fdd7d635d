"""One error hierarchy: retryable vs fatal, so callers decide without string matching."""


class BudgetqError(Exception):
    """Base of every error budgetq raises on purpose."""


class ConfigError(BudgetqError):
    """The configuration (file, env or flags) is wrong; the message names the field."""


class FatalRequestError(BudgetqError):
    """The server rejected the request for good (HTTP 4xx such as context length)."""


class RetryableRequestError(BudgetqError):
    """A transient server or network failure: the same request may succeed later."""


class BadResponseError(BudgetqError):
    """The server answered with something budgetq cannot read."""


class AbortedResponseError(RetryableRequestError):
    """The server answered, but with an aborted request (finish_reason abort): not a result."""


class DuplicateRidError(RetryableRequestError):
    """The server still holds this rid (SGLang 400 "Duplicate request ID"): retry with a new one."""
