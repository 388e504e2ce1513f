"""Comparisons beyond the five methods of the step bench: the schedules side by side
(``schedules``, ``gradgate bench --schedules``), bytes all-reduced under DDP (``distributed``,
``--distributed``), ZeRO's optimizer state and traffic (``deepspeed``), and which modules
should learn at equal budgets (``learners``), and training only new tokens' rows against a full
embedding and a gradient mask (``rows``), and a step with ``gg.PrefixCache`` against the gate
alone (``prefix_cache``, ``--prefix-cache``). Each also runs on its own with ``python -m``."""
