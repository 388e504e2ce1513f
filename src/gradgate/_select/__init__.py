"""Layer 2, selection: which modules? It changes nothing.

``names`` turns names, globs, ranges and block positions into modules (``gg.select``) and checks
what callers pass; ``blocks`` finds a model's repeated block sequence (``gg.blocks``), or says
why it cannot.

May import: ``_plumbing``.
"""
