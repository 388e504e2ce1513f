"""``gradgate demo``: the seeds' questions answered with measured evidence, and a report.

Sections: (a) the seeds' conv-stack scenarios with their audit tables; (b) a real training run
on scikit-learn's bundled digits, full backprop against a random depth per minibatch; (c) the
intermediate-gradient, optimizer-drift and actor-critic answers; (d) one self-contained HTML
report with graphs, tables and plots.
"""

from __future__ import annotations

from pathlib import Path

from ._answers import answers
from ._digits import train_digits
from ._page import write_report
from .._progress import Progress
from ._scenarios import seed_scenarios


def run_demo(*, out: str | Path, epochs: int = 6, seed: int = 0) -> int:
    """Run every section, print the evidence, write the HTML report; returns 0."""
    progress = Progress(total=4)
    scenarios = seed_scenarios()
    progress.advance("seed scenarios audited")
    runs = train_digits(epochs=epochs, seed=seed)
    progress.advance("digits trained")
    findings = answers()
    progress.advance("questions answered")
    path = write_report(Path(out), scenarios, runs, findings)
    progress.advance("report written")
    progress.close()

    print("gradgate demo: where do gradients flow, and what does backward compute?\n")
    for scenario in scenarios:
        print(f"== {scenario.title}\n{scenario.report.table()}\n")
    print("== digits (scikit-learn, offline): full backprop vs a random depth per minibatch")
    for run in runs:
        print(f"   {run.summary()}")
    full, gated = runs
    print(
        f"   random depth: {gated.backward_flops / full.backward_flops:.2f}x the backward "
        f"FLOPs of full backprop, median step {gated.median_step / full.median_step:.2f}x "
        "(steps interleaved in one process)\n"
    )
    print("== answers")
    for answer in findings:
        print(f" - {answer.question}\n   {answer.sentence}")
    print(f"\nreport: {path.resolve()}")
    return 0
