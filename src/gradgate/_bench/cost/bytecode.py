"""How much of gradgate's own Python one gated training step runs: bytecode instructions and
calls into C made from gradgate's code, per bench model and depth.

Unlike a step's time on a shared machine, these counts are the same at every run (for one
Python and one torch), so a change to the gate's hot path shows exactly what it removed;
compare two checkouts by pointing ``PYTHONPATH`` at each::

    PYTHONPATH=src python -m gradgate._bench.cost.bytecode
    PYTHONPATH=<other checkout>/src python -m gradgate._bench.cost.bytecode \
        --models gpt2 --depths 0,1

A step is forward, loss, backward, optimizer step and ``zero_grad``, after three warm-up steps
at the same depth (with ``--cycle``: after a step at the depth listed before it, as in the
bench, which interleaves depths). The benchmark's own modules (``gradgate._bench``) are not
counted.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable
from functools import partial
from types import (
    BuiltinFunctionType,
    BuiltinMethodType,
    CodeType,
    FrameType,
    MethodWrapperType,
    WrapperDescriptorType,
)
from typing import Any

import torch

_BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PACKAGE = os.path.dirname(os.path.dirname(_BENCH)) + os.sep


def _ours(code: CodeType) -> bool:
    """Code in gradgate's own folder, not in the benchmark's (a path that merely contains
    "gradgate", such as a clone's ``.venv``, is not ours)."""
    name = code.co_filename
    return name.startswith(_PACKAGE) and not name.startswith(_BENCH)


def count(step: Callable[[], object]) -> tuple[collections.Counter[str], int]:
    """Bytecode instructions per gradgate function, and calls of C functions from gradgate's
    code, in one call of ``step``: with ``sys.monitoring`` from Python 3.12 (where ``settrace``'s
    opcode events are unreliable), else with ``sys.settrace``. Counts differ between Pythons:
    compare runs of one.

    >>> import gradgate as gg, torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> gate = gg.BackpropGate(model, depth=1)
    >>> instructions, c_calls = count(lambda: model(torch.ones(1, 2)))
    >>> instructions["_enter_root"] > 0 and c_calls > 0
    True
    >>> gate.remove()
    """
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        return _count_monitored(step, monitoring)
    return _count_traced(step)


def _count_traced(step: Callable[[], object]) -> tuple[collections.Counter[str], int]:
    instructions: collections.Counter[str] = collections.Counter()
    c_calls = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if not _ours(frame.f_code):
            return None
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        name = frame.f_code.co_name

        def each(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                instructions[name] += 1
            return each

        return each

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal c_calls
        c_calls += event == "c_call" and _ours(frame.f_code)

    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return instructions, c_calls


def _count_monitored(
    step: Callable[[], object], monitoring: Any
) -> tuple[collections.Counter[str], int]:
    instructions: collections.Counter[str] = collections.Counter()
    c_calls = 0
    events = monitoring.events
    tool = next(i for i in range(6) if monitoring.get_tool(i) is None)

    def instruction(code: CodeType, offset: int) -> Any:
        if not _ours(code):
            return monitoring.DISABLE  # at this place in this code, for good: much faster
        instructions[code.co_name] += 1
        return None

    def call(code: CodeType, offset: int, called: object, arg0: object) -> Any:
        nonlocal c_calls
        if not _ours(code):
            return monitoring.DISABLE
        c_calls += isinstance(called, _C_FUNCTIONS)
        return None

    monitoring.use_tool_id(tool, "gradgate bytecode count")
    try:
        monitoring.register_callback(tool, events.INSTRUCTION, instruction)
        monitoring.register_callback(tool, events.CALL, call)
        monitoring.restart_events()  # the places an earlier count disabled
        monitoring.set_events(tool, events.INSTRUCTION | events.CALL)
        step()
    finally:
        monitoring.set_events(tool, 0)
        monitoring.free_tool_id(tool)
    return instructions, c_calls


_C_FUNCTIONS = (BuiltinFunctionType, BuiltinMethodType, MethodWrapperType, WrapperDescriptorType)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="conv_stack,gpt2,llama,transformer")
    parser.add_argument("--depths", default="0,1,all")
    parser.add_argument("--size", default="tiny", choices=["tiny", "quick"])
    parser.add_argument("--top", type=int, default=4, help="functions named per row")
    parser.add_argument(
        "--cycle",
        action="store_true",
        help="each counted step follows a step at the depth before it in --depths (as the "
        "bench interleaves them), not steps at its own depth",
    )
    args = parser.parse_args()
    from ..catalog import FACTORIES
    from ..methods import Runner

    depths = [None if d == "all" else int(d) for d in args.depths.split(",")]
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {args.size} sizes")
    print("model        depth  bytecodes  C calls  most in")
    for name in args.models.split(","):
        runner = Runner(FACTORIES[name](size=args.size))
        for _ in range(3 if args.cycle else 0):
            for depth in depths:
                runner.step("gradgate", depth)
        for depth in depths:
            step = partial(runner.step, "gradgate", depth)
            for _ in range(1 if args.cycle else 4):  # warm-up steps, then the counted one
                instructions, c_calls = count(step)
            top = ", ".join(f"{f} {n}" for f, n in instructions.most_common(args.top))
            total = sum(instructions.values())
            print(f"{name:12} {depth!s:>5}  {total:9}  {c_calls:7}  {top}")
        runner.close()


if __name__ == "__main__":
    main()
