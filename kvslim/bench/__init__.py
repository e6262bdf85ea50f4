"""Speed measurements in llama-bench's terms (pp/tg at a depth), shared by
``kvslim bench`` and the scripts in ``benchmarks/``."""
from .runner import FilledCache, Test, measure

__all__ = ["FilledCache", "Test", "measure"]
