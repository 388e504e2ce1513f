"""The ``--schedules`` section: every schedule in ``gg.schedules`` side by side over the same steps.

One residual MLP stack, AdamW, the same batches for every method: backward FLOPs and bytes
saved for backward (``gg.audit``) and optimizer state bytes after the last step, each as a
ratio to full backprop (state: to the parameters' bytes).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import gradgate as gg


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.mlp(self.norm(x))
        return out


def _model(blocks: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, width), *[_Block(width) for _ in range(blocks)], nn.Linear(width, 1)
    )


# Schedules of gg.schedules that this section leaves out, each with the reason (none today).
EXCLUDED: dict[type[gg.schedules.Schedule], str] = {}


def _schedules(n: int, steps: int) -> dict[str, gg.schedules.Schedule | None]:
    """Full backprop, then every registered schedule but the excluded ones, as registered."""
    methods: dict[str, gg.schedules.Schedule | None] = {"full backprop": None}
    for kind, build in gg.schedules._REGISTRY.items():
        if kind not in EXCLUDED:
            methods[kind.__name__] = build(n, steps, 0)
    return methods


def measure(*, blocks: int = 6, width: int = 64, steps: int = 8) -> list[dict[str, Any]]:
    """One row per method: its totals over ``steps`` and its ratios to full backprop."""
    torch.manual_seed(0)
    base = _model(blocks, width)
    batches = [torch.randn(32, 16) for _ in range(steps)]
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    rows = []
    for name, schedule in _schedules(blocks, steps).items():
        model = copy.deepcopy(base)
        gate = gg.BackpropGate(model, [str(i) for i in range(1, blocks + 1)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        flops = saved = 0
        for step, x in enumerate(batches):
            if schedule is not None:
                schedule.apply(gate, step)
            with gg.audit(model) as report:
                model(x).pow(2).mean().backward()
            if schedule is not None:
                schedule.observe(model)  # Importance scores the gradients; the others ignore them
            flops += report.totals["backward_flops"]
            saved += report.totals["saved_bytes"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if schedule is not None:
                gg.optim.drop_finished(optimizer, gate, schedule, step + 1)
        gate.remove()
        state = gg.optim.state_bytes(optimizer)
        rows.append(
            {
                "method": name,
                "backward_flops": flops,
                "saved_bytes": saved,
                "optimizer_state_bytes": state,
                "parameter_bytes": param_bytes,
            }
        )
    full = rows[0]
    for row in rows:
        row["flops_ratio"] = row["backward_flops"] / full["backward_flops"]
        row["saved_ratio"] = row["saved_bytes"] / full["saved_bytes"]
        row["state_ratio"] = row["optimizer_state_bytes"] / param_bytes
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The section as text: one line per method."""
    lines = [
        "Schedules over the same steps (residual MLP stack, AdamW; ratios to full backprop, "
        "optimizer state to parameter bytes)",
        f"{'method':>16}  {'backward FLOPs':>14}  {'saved bytes':>11}  {'AdamW state':>11}",
    ]
    for row in rows:
        lines.append(
            f"{row['method']:>16}  {row['flops_ratio']:>14.2f}  {row['saved_ratio']:>11.2f}  "
            f"{row['state_ratio']:>10.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(measure()))
