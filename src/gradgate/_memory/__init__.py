"""Layer 5, memory plans: how much memory will a step need, before anything runs?

``estimate`` (``gg.estimate`` and ``StepPlanner``: a whole training step simulated on fake
tensors, per depth or learning set), ``options`` (its options, and the optimizer torch runs on
the target device), ``twin`` (the fake copy of the model and its inputs), ``step`` (one step
per row), ``counter`` (the live bytes of every storage), ``replay`` (blocks before the cut run
once), ``memory_plan`` (``MemoryPlan`` and ``MemoryRow``, the result: ``fits``, text, JSON,
HTML), ``budget`` (a row's peak plus headroom, sizes, the depths planned around a budget),
``configs`` and ``plan_command`` (``gradgate plan``: a transformers config planned on
the meta device), ``learners`` (its ``--learn`` and ``--freeze``, and what learns in a row, in
words), ``sharding/`` (one rank of several: DDP, FSDP2 and DeepSpeed ZeRO emulated on the
twin).

May import: ``_plumbing``, ``_select``, ``_cut``, ``_tools``; not ``_observe``, the other half
of this layer. ``masters="fp32"`` plans by running ``LearnerMasters`` (``_tools/masters``).
"""
