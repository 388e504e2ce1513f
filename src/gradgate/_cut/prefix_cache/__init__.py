"""Skip the frozen prefix (``gg.PrefixCache``): at a fixed cut, the blocks before it compute
the same input to the first learner for the same sample at every epoch, so it is stored once
and read from then on.

``cache`` is the public ``PrefixCache``; ``run`` is one forward (hits, misses, what each block
call becomes); ``wrappers`` are its forward wrappers on the root and the blocks; ``prefix``
says where the cut is and what lies before it; ``rows`` cuts batches into samples and back;
``fingerprint`` hashes weights and inputs; ``keys`` checks the keys and keys datasets;
``stores`` holds the entries in memory or on disk.

May import: ``_plumbing``, ``_select``, the rest of ``_cut``.
"""

from .cache import CacheStats, PrefixCache

__all__ = ["CacheStats", "PrefixCache"]
