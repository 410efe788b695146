"""What the package's command-line modules (``python -m ctxfs.capture``, ``python -m
ctxfs.bench_model``) share: help that shows each option's default, and sizes written as the
``ctxfs`` command takes them."""

from __future__ import annotations

import argparse

_UNITS = {"": 0, "b": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20, "g": 30, "gb": 30, "gib": 30,
          "t": 40, "tb": 40, "tib": 40}


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and ``(default: ...)`` after each option's help
    where it has a default its help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == [] or "(default" in text:
            return text
        return super()._get_help_string(action)


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``256M``, ``1.5G`` (binary multiples), rounded down."""
    t = text.strip().lower()
    digits = len(t) - len(t.lstrip("0123456789."))
    number, unit = t[:digits], t[digits:].strip()
    if unit not in _UNITS or not number:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a number with an optional K, M, G or T suffix")
    try:
        return int(float(number) * (1 << _UNITS[unit])) if "." in number else int(number) << _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}") from None
