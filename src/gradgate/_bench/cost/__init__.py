"""What gradgate's own code costs a step: bytecodes run (``bytecode``), the hooks' CPU time
(``hook_cost``), a depth change every step and the audit (``overheads``, a section of
``gradgate bench``), and where the gated step's time goes (``profile``)."""
