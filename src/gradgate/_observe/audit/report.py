"""``AuditReport``: the audit itself (a context manager, used once) and what it measured."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from ..._plumbing.errors import AuditNotReadyError, InvalidOptionError, NoBackwardWarning, warn
from ..._plumbing.html import page
from .records import ModuleRecord, WastedGradient
from .render import Figures, dumps, html_sections, loads, render_table

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .kernels import KernelTable
    from .recorder import Recorder

_State = Literal["ready", "recording", "done"]


class AuditReport:
    """What backward computed, per module: returned by :func:`gradgate.audit`.

    Use it once as a context manager around the forward and the backward; afterwards
    ``modules`` lists every module of the model in order (leaf rows, and parents with the sum
    over everything inside them; the root, named ``""``, holds the whole model), ``outside``
    the work done outside the model (the loss, in most scripts), ``totals`` the root's figures
    and ``wasted`` the gradients computed for nothing. In Jupyter the report shows as a table.

    >>> import torch, gradgate as gg
    >>> net = torch.nn.Sequential(*[torch.nn.Conv2d(3, 3, 3) for _ in range(3)])
    >>> with gg.audit(net) as report:
    ...     net(torch.randn(1, 3, 12, 12)).mean().backward()
    >>> report.totals["wgrad"], report.totals["dgrad"]
    (3, 2)
    >>> gg.AuditReport.from_json(report.to_json()).totals == report.totals
    True
    """

    def __init__(self) -> None:
        self._state: _State = "done"
        self._figures = Figures([], ModuleRecord("(outside model)", ""), [], True, True)
        self._recorder: Recorder | None = None
        self._kernels: KernelTable | None = None
        self._kernels_requested = False

    @classmethod
    def _recording(
        cls, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, kernels: bool
    ) -> AuditReport:
        from .recorder import Recorder

        report = cls()
        report._state = "ready"
        report._recorder = Recorder(model, optimizer, kernels=kernels)
        report._kernels_requested = kernels
        return report

    # -- the context manager -------------------------------------------------------------------
    def __enter__(self) -> AuditReport:
        if self._state != "ready" or self._recorder is None:
            raise AuditNotReadyError(
                f"this audit has already {'recorded' if self._state == 'done' else 'started'}: "
                "an AuditReport records once. Call gg.audit(model) again for a new audit."
            )
        self._recorder.start()
        self._state = "recording"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None or self._state != "recording":
            return
        self._figures = recorder.stop()
        self._state = "done"
        if self._kernels_requested:
            from .kernels import KernelTable

            self._kernels = KernelTable(tuple(recorder.kernel_rows))
        if exc_type is None and recorder.forward_built_graph and not self._figures.backward_seen:
            warn(
                "gg.audit ended without a backward pass: the forward inside it built a graph, "
                "but loss.backward() ran after the `with` block (or not at all), so wgrad, "
                "dgrad and backward FLOPs read 0. Call loss.backward() inside "
                "`with gg.audit(model) as report:`.",
                NoBackwardWarning,
            )

    def _done(self) -> Figures:
        if self._state == "ready":
            raise AuditNotReadyError(
                "this audit has not run: gg.audit(model) only prepares it. Use it as a context "
                "manager, then read the report: `with gg.audit(model) as report: "
                "loss = loss_fn(model(x), y); loss.backward()` and then report.table()."
            )
        if self._state == "recording":
            raise AuditNotReadyError(
                "this audit is still recording: read the report after the "
                "`with gg.audit(model) as report:` block has ended."
            )
        return self._figures

    # -- the figures ---------------------------------------------------------------------------
    @property
    def modules(self) -> list[ModuleRecord]:
        """One record per module, in model order; the root (``""``) first."""
        return self._done().modules

    @property
    def outside(self) -> ModuleRecord:
        """The work done outside the model (usually the loss); not in ``totals``."""
        return self._done().outside

    @property
    def wasted(self) -> list[WastedGradient]:
        """Parameter gradients computed although nothing uses them."""
        return self._done().wasted

    @property
    def forward_seen(self) -> bool:
        """Whether the forward ran inside the audit (else saved bytes are unknown)."""
        return self._done().forward_seen

    @property
    def backward_seen(self) -> bool:
        """Whether a backward ran inside the audit (else wgrad, dgrad and FLOPs are 0)."""
        return self._done().backward_seen

    @property
    def totals(self) -> dict[str, int]:
        """``wgrad``, ``dgrad``, ``backward_flops`` and ``saved_bytes`` of the whole model."""
        return self._done().totals

    @property
    def wasted_flops(self) -> int:
        """Backward FLOPs spent on gradients nothing uses."""
        return self._done().wasted_flops

    @property
    def kernels(self) -> KernelTable:
        """The CUDA kernels of the audited step (``gg.audit(model, kernels=True)``): rows,
        ``counts`` per kind (wgrad / dgrad / forward / other) and the Nsight-style ``table()``."""
        self._done()
        if self._kernels is None:
            raise AuditNotReadyError(
                "report.kernels is recorded only with gg.audit(model, kernels=True) on a CUDA "
                "device; this audit ran without it."
            )
        return self._kernels

    def module(self, name: str) -> ModuleRecord:
        """The record of one module by qualified name (``""`` is the whole model)."""
        records = self._done().modules
        for record in records:
            if record.name == name:
                return record
        known = ", ".join(repr(r.name) for r in records[:8])
        raise KeyError(f"no module {name!r} in this audit; known: {known}")

    # -- output --------------------------------------------------------------------------------
    def table(self, *, depth: int | None = None) -> str:
        """A text table: one row per module, indented by nesting, then totals and waste;
        ``depth`` (``0`` the model row only, ``1`` its children too, ...) limits nesting."""
        if depth is not None and (
            isinstance(depth, bool) or not isinstance(depth, int) or depth < 0
        ):
            raise InvalidOptionError(
                f"report.table(depth=...) got {depth!r}; expected None (every module) or an "
                "integer >= 0 (0: the model row only, 1: its children too, ...)."
            )
        return render_table(self._done(), depth=depth)

    def to_json(self) -> str:
        """The report as JSON (schema ``gradgate.audit/1``, see ``docs/audit.md``)."""
        return dumps(self._done())

    @classmethod
    def from_json(cls, text: str) -> AuditReport:
        """Load a report written by :meth:`to_json`."""
        report = cls()
        report._figures = loads(text)
        return report

    def html(self, *, heading: int = 2) -> str:
        """The totals, the per-module table and the wasted gradients as HTML sections."""
        return html_sections(self._done(), heading=heading)

    def to_html(self, path: str | Path, *, title: str = "gradgate audit") -> Path:
        """Write a self-contained HTML page with the tables; returns the path written."""
        import html

        path = Path(path)
        body = f"<h1>{html.escape(title)}</h1>{self.html()}"
        path.write_text(page(title, body), encoding="utf-8")
        return path

    def _repr_html_(self) -> str:
        if self._state != "done":
            import html

            return f"<p>{html.escape(repr(self))}</p>"
        return self.html(heading=4)

    def __repr__(self) -> str:
        if self._state != "done":
            state = "not run yet" if self._state == "ready" else "recording"
            return f"<gradgate.AuditReport ({state})>"
        return f"<gradgate.AuditReport {self.totals}>"
