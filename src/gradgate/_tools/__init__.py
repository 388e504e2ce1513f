"""Layer 4, gradient tools: which parameters learn, and what happens to their gradients.

``freeze`` (``gg.freeze`` / ``frozen`` / ``unfreeze``, with ``tied``: the warning for a freeze
that reaches a parameter another module shares, and ``optimizer``: adding or removing a frozen
parameter's optimizer group), ``masters`` (``LearnerMasters``, exported by ``gg.optim``: fp32
masters and optimizer state only for the parameters that learn; ``masters_checks``: what it
refuses, named exactly; ``sharded``: its FSDP2 side and ``gg.optim.clip_grad_norm_``),
``transform`` (``scale_grad``, ``reverse_grad``, ``clip_grad``,
``zero_grad_of``, ``grad_transform``), ``capture`` (``capture_grads``) and ``rows``
(``learn_rows``: only some rows of an embedding's or a head's weight learn, with ``row_grads``:
how they get their gradient).

May import: ``_plumbing``, ``_select``, ``_cut``.
"""
