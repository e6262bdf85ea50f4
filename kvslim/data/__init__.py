"""Data that ships inside the package: the bundled model and held-out text."""
from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent
TEXT = DATA / "text"
# The held-out split of three corpus sources, in the order the README's tables were measured in.
HELDOUT_FILES = tuple(TEXT / f"{source}-heldout.txt" for source in ("austen", "classics", "bible"))
HELDOUT_TEXT = HELDOUT_FILES[0]
DOC_SEPARATOR = "\n\n\f\n"
# The bundled model's config allows 32768 positions, but it was trained on sequences of at
# most 4096 tokens (its card, README.md beside the weights): past that, retrieval falls off.
BUNDLED_TRAINED_CONTEXT = 4096


def heldout_documents() -> list[str]:
    """The held-out Austen chapters the bundled model never trained on."""
    return [d.strip() for d in HELDOUT_TEXT.read_text(encoding="utf-8").split(DOC_SEPARATOR) if d.strip()]
