"""Layer 1, shared plumbing: what every other layer uses and no user sees.

The errors and warnings (``errors``), the one home of private torch APIs (``torch_internals``),
option checks (``validate``), removable handles (``handles``), the one walk over autograd graphs
and reader of saved tensors (``autograd``), which module created a node (``tagging``), module
hooks and ``forward`` wrappers (``hooks``, ``hook_set``, ``frames_compile``), the HTML shell
and progress bars (``html``, ``progress``), and numbers in units people read (``units``).

May import: torch, and ``gradgate._hooks`` (what copies of hooks become, at the path pickles
name). Nothing else of gradgate.
"""
