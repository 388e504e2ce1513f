"""Layer 5, observation: what did backward compute, and what went wrong?

``audit`` (``gg.audit``: wgrad, dgrad, FLOPs, saved bytes per module), ``graph`` (``gg.graph``:
the autograd graph grouped by module), ``check`` (``gg.check``: the classic mistakes in a model
and its optimizer) and ``explain`` (``gg.explain``: PyTorch's autograd errors with their fix).

May import: ``_plumbing``, ``_select``, ``_cut``, ``_tools``; not ``_memory``, the other half of
this layer.
"""
