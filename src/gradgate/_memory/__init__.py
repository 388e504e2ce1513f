"""Layer 5, memory plans: how much memory will a step need, before anything runs?

``estimate`` (``gg.estimate``: a training step planned on fake tensors, per depth or learning
set), ``memory_plan`` (``MemoryPlan`` and ``MemoryRow``, the result: ``fits``, text, JSON, HTML)
and ``plan_command`` (``gradgate plan``: a transformers config planned on the meta device).

May import: ``_plumbing``, ``_select``, ``_cut``, ``_tools``; not ``_observe``, the other half
of this layer.
"""
