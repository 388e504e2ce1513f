"""Layer 3, the cut: where does the graph start? The gates and everything they run on.

``gate`` holds the public gates (``BackpropGate``, ``backprop_depth``, ``stop_gradient_at``) on
top of ``cut``, the mechanism (a wrapper around the root's ``forward`` that turns grad off and
restores it), whose block hooks are in ``cut_blocks``. ``block_calls`` decides what happens to one
block call (frozen for the call, skipped, checked); ``frames`` keeps, per thread, what a gated
forward changed; ``stacks`` follows the block stacks as they run; ``plans`` holds a plan's tables
and its rank key; ``held`` the parameters frozen until backward is done; ``stale_grads`` keeps
optimizers off parameters that did not learn; ``fsdp`` and ``ranks`` serve FSDP2, DDP and the
rank check; ``compile`` is ``compile_blocks``; ``prefix_cache/`` is ``PrefixCache``, which skips
the blocks before the cut for samples it has seen.

May import: ``_plumbing``, ``_select``.
"""
