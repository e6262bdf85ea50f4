"""Data that ships inside the package: the bundled model and held-out text."""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent
HELDOUT_TEXT = DATA / "text" / "austen-heldout.txt"
DOC_SEPARATOR = "\n\n\f\n"


def heldout_documents() -> list[str]:
    """The held-out chapters the bundled model never trained on."""
    return [d.strip() for d in HELDOUT_TEXT.read_text(encoding="utf-8").split(DOC_SEPARATOR) if d.strip()]
