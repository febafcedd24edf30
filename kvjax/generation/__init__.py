"""Batched generation over the paged cache: jitted prefill, then a while_loop decode.

Prompts are right-padded to a multiple of ``pad_multiple`` tokens, so prompts of
nearby lengths share one compiled program; each sequence keeps its own length,
positions and cache lengths. Compiled programs are kept per (static
configuration, shapes), and compile time is reported apart from run time.

Modules: ``api`` (generate, generate_each, decode and their results),
``inputs`` (argument checks, tokenizing, padding), ``plan`` (what one
(policy, budget) run allocates and calls), ``programs`` (the bodies of the
compiled programs), ``state`` (the decode loop's carry), ``sampling`` (how
the next token is picked), ``compile`` (compiling and timing programs),
``saved`` (compress once, save, load, answer many questions).
"""

from kvjax.generation.api import GenerationResult
from kvjax.generation.api import GenerationStats
from kvjax.generation.api import decode
from kvjax.generation.api import generate
from kvjax.generation.api import generate_each
from kvjax.generation.compile import COMPILE_COUNT
from kvjax.generation.sampling import Greedy
from kvjax.generation.sampling import Temperature
from kvjax.generation.sampling import TopK
from kvjax.generation.saved import CompressedContext
from kvjax.generation.saved import answer
from kvjax.generation.saved import compress
from kvjax.generation.saved import load_cache
from kvjax.generation.saved import save_cache

__all__ = [
    "COMPILE_COUNT",
    "CompressedContext",
    "GenerationResult",
    "GenerationStats",
    "Greedy",
    "Temperature",
    "TopK",
    "answer",
    "compress",
    "decode",
    "generate",
    "generate_each",
    "load_cache",
    "save_cache",
]
