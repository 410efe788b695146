"""The exceptions ctxfs raises: ``Error`` and one subclass per kind of failure, each carrying
the Rust message. Each also derives from the built-in exception a Python caller would catch
for that kind (``InputError`` is a ``ValueError``, ``NotFoundError`` a ``LookupError``,
``IoError`` an ``OSError``), so code written against the standard library's conventions
catches them too."""

from __future__ import annotations


class Error(Exception):
    """A ctxfs operation failed."""


class InputError(Error, ValueError):
    """Bad input (shape, dtype, non-finite value, unknown layer or plan); nothing was written."""


class StoreFullError(Error):
    """The store lacks the space an import or store needs; nothing was written."""


class ExistsError(Error):
    """A context with that name already exists."""


class NotFoundError(Error, LookupError):
    """No context with that name."""


class CorruptError(Error):
    """A block or stream failed verification; the message names the block."""


class LockedError(Error):
    """Another writer holds the store."""


class ReadOnlyError(Error):
    """The store is open read-only."""


class NotAStoreError(Error):
    """The path holds no ctxfs store (or one this build cannot read)."""


class IoError(Error, OSError):
    """The device failed an I/O, or a path could not be opened."""


class OverBudgetError(Error):
    """Serving the context would hold more of its index resident than the store's
    resident_budget allows."""


__all__ = [
    "Error",
    "InputError",
    "StoreFullError",
    "ExistsError",
    "NotFoundError",
    "CorruptError",
    "LockedError",
    "ReadOnlyError",
    "NotAStoreError",
    "IoError",
    "OverBudgetError",
]
