"""Long texts of three kinds, built from what every CPython installation carries, so tests
and benchmarks need no download: source code (standard-library modules), prose (the
library reference's topic pages in ``pydoc_data``) and structured text (a CSV table of
Unicode character properties)."""

from __future__ import annotations

import inspect
import unicodedata

KINDS = ("code", "prose", "structured")


def code() -> str:
    import argparse
    import dataclasses
    import email.message
    import json.decoder
    import tarfile
    import textwrap

    return "\n\n".join(inspect.getsource(m) for m in (argparse, textwrap, dataclasses, json.decoder, email.message, tarfile))


def prose() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def structured() -> str:
    rows = ["codepoint,character,name,category,bidirectional,east_asian_width,decimal"]
    for cp in range(0x20, 0x3000):
        ch = chr(cp)
        name = unicodedata.name(ch, "")
        if not name:
            continue
        shown = ch if ch.isprintable() and ch not in ',"' else ""
        rows.append(
            f"U+{cp:04X},{shown},{name},{unicodedata.category(ch)},"
            f"{unicodedata.bidirectional(ch)},{unicodedata.east_asian_width(ch)},{unicodedata.decimal(ch, '')}"
        )
    return "\n".join(rows)


def text(kind: str) -> str:
    """The text of one kind (``KINDS``)."""
    return {"code": code, "prose": prose, "structured": structured}[kind]()
