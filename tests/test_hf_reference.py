"""The HF Trainer with GateCallback: every optimizer step's update against a hand-written reference.

A tiny random GPT-2 is trained by the real ``transformers.Trainer`` with plain SGD (constant
learning rate, no clipping, no weight decay), so the update of a parameter is exactly
``-lr * grad``; gradient accumulation over two micro-batches and HF's non-reentrant gradient
checkpointing are on. For each optimizer step the test takes the parameters before the step and
the micro-batches the Trainer fed, and recomputes the gradient by hand with plain autograd on a
fresh copy of the model loaded with those parameters (not a deepcopy of the trained model, which
would carry the gate's hooks and the flags it holds; no checkpointing), for the step's plan
(``schedule.plan(step)``):

* depth plans: the input of the first learning block is detached (nothing before it learns;
  the head's weight, tied to the token embedding, gets only the head's gradient);
* learn plans (LISA): everything downstream of the earliest learner is recorded and only the
  learners' gradients are kept (the drawn blocks, the named modules, the final norm and head);
* skip plans (DropBP): each skipped block's output is replaced by ``x + f(x).detach()``, so the
  gradient reaches ``x`` through the identity only.

The micro-batches are combined as HF does (token losses summed, divided by
``num_items_in_batch``). Learners must move by ``-lr`` times that gradient; every other
parameter must stay bit-identical. The HF ``log_history`` must carry the plan's ``gradgate/*``
numbers at every logging step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from models import Tokens, tiny_gpt2, trainer_args
from torch import nn

import gradgate as gg

transformers = pytest.importorskip("transformers")

N = 4
LR = 0.5
STEPS = 3
ACCUMULATE = 2

pytestmark = [
    pytest.mark.slow,  # the real HF Trainer: seconds per test
    pytest.mark.skipif(
        importlib.util.find_spec("accelerate") is None, reason="the HF Trainer needs accelerate"
    ),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:transformers.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:accelerate.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.*"),
    # tied GPT-2 under a depth plan: the embedding's use before the cut gets no gradient
    pytest.mark.filterwarnings("ignore::gradgate.SharedParameterWarning"),
]


class Recorder(transformers.TrainerCallback):
    """Per optimizer step: the parameters before and after, the micro-batches, the plan set."""

    def __init__(self, gate_callback) -> None:
        self.gate_callback = gate_callback
        self.steps: list[dict] = []
        self.hook = None

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        if self.hook is None:
            self.hook = model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self.steps.append(
            {
                "global_step": state.global_step,
                "plan": self.gate_callback.plan,
                "before": {n: p.detach().clone() for n, p in model.named_parameters()},
                "batches": [],
            }
        )

    def _forward(self, module, args, kwargs) -> None:
        gate = self.gate_callback.gate
        self.steps[-1]["batches"].append(
            {
                "input_ids": kwargs["input_ids"].clone(),
                "labels": kwargs["labels"].clone(),
                "num_items_in_batch": _number(kwargs.get("num_items_in_batch")),
                "plan": (gate.depth, gate.learn, gate.skip),
            }
        )

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.steps[-1]["after"] = {n: p.detach().clone() for n, p in model.named_parameters()}


def _number(value) -> int | None:
    return None if value is None else int(value)


def train(schedule, tmp_path: Path, *, lr: float = LR):
    model = tiny_gpt2(N)
    callback = gg.integrations.transformers.GateCallback(schedule)
    recorder = Recorder(callback)
    args = trainer_args(
        tmp_path,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE,
        max_grad_norm=0.0,  # no clipping
        lr_scheduler_type="constant",
        warmup_steps=0,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[callback, recorder],
        optimizers=(optimizer, None),
    )
    trainer.train()
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5
    if checkpointing is None:
        checkpointing = model.is_gradient_checkpointing
    assert checkpointing  # the blocks really were checkpointed
    return model, trainer, recorder


def reference_grads(
    before: dict[str, torch.Tensor], batches: list[dict], plan: gg.schedules.Plan
) -> dict[str, torch.Tensor]:
    """By hand: the step's plan on a fresh copy, mean over micro-batches; only learners listed."""
    ref = tiny_gpt2(N)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(before[name])
    ref.train()
    blocks = ref.transformer.h
    hooks = []
    learners: list[str] = ["transformer.ln_f.", "lm_head."]  # what runs after the last block
    learners += [f"transformer.h.{i}." for i in plan.learning(N)]
    first: int | None = None  # the block whose input is cut
    if plan.depth is not None:
        first = N - plan.depth
    elif plan.learn is not None:
        learners += [f"{name}." for name in plan.learn if isinstance(name, str)]
        if all(isinstance(item, int) for item in plan.learn):
            first = min(plan.learn)
    else:
        learners += ["transformer.wte.", "transformer.wpe."]  # no cut: everything learns
    if first is not None and first < N:

        def cut(module, args, kwargs):
            if args:
                return (args[0].detach(), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach()}

        hooks.append(blocks[first].register_forward_pre_hook(cut, with_kwargs=True))

    def around(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        through = x + (out - x).detach()  # x + f(x), f recorded no graph for x
        return (through, *output[1:]) if isinstance(output, tuple) else through

    for i in plan.skip:
        hooks.append(blocks[i].register_forward_hook(around, with_kwargs=True))

    # by identity: the head's weight is the token embedding's (tied), named once
    learning = {
        id(p)
        for name, module in ref.named_modules()
        if any(f"{name}.".startswith(pre) for pre in learners)
        for p in module.parameters()
    }
    params = {n: p for n, p in ref.named_parameters() if id(p) in learning}
    # HF sums the token losses of the step's micro-batches and divides by num_items_in_batch,
    # the count of labels before the causal shift (here 2 x 2 x 8 = 32 for 28 predicted tokens)
    items = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert [b["num_items_in_batch"] for b in batches] == [items] * len(batches)
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for batch in batches:
        logits = ref(input_ids=batch["input_ids"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )
        grads = torch.autograd.grad(loss / items, list(params.values()))
        for name, grad in zip(params, grads, strict=True):
            total[name] += grad
    for hook in hooks:
        hook.remove()
    return total


def check_steps(schedule, recorder: Recorder, *, lr: float = LR) -> None:
    assert [s["global_step"] for s in recorder.steps] == list(range(STEPS))
    for step, record in enumerate(recorder.steps):
        plan = schedule.plan(step)
        assert record["plan"] == plan
        # one plan per optimizer step, the same for both micro-batches
        planned = (plan.depth, plan.learn, plan.skip)
        assert [b["plan"] for b in record["batches"]] == [planned] * ACCUMULATE
        expected = reference_grads(record["before"], record["batches"], plan)
        assert expected, "no learner at all: the test would check nothing"
        for name, after in record["after"].items():
            before = record["before"][name]
            if name in expected:
                want = before - lr * expected[name]
                assert not torch.equal(want, before), f"step {step}: {name} has no update"
                torch.testing.assert_close(
                    after,
                    want,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}",
                )
            else:
                assert torch.equal(after, before), f"step {step}: {name} moved but not learning"


def check_logs(schedule, trainer, model: nn.Module) -> None:
    """The plan's numbers, and what learns under it: each learning block's parameter count and
    the total, with the final norm and the head (tied to the embedding) that learn under a cut,
    and everything around the blocks without one (DropBP)."""
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1))  # every logging step
    blocks = model.transformer.h
    after = sum(p.numel() for m in (model.transformer.ln_f, model.lm_head) for p in m.parameters())
    outside = sum(p.numel() for p in model.parameters()) - sum(
        p.numel() for p in blocks.parameters()
    )
    for entry in logged:
        plan = schedule.plan(entry["step"] - 1)
        found = {k: v for k, v in entry.items() if k.startswith("gradgate/")}
        learns = {
            f"gradgate/learns/transformer.h.{i}": float(
                sum(p.numel() for p in blocks[i].parameters())
            )
            for i in sorted(plan.learning(N))
        }
        cut = plan.depth is not None or plan.learn is not None  # else no cut: all learn
        total = sum(learns.values()) + (after if cut else outside)
        expected = {f"gradgate/{k}": float(v) for k, v in plan.metrics(N).items()}
        assert found == {**expected, **learns, "gradgate/learning_parameters": total}


def test_hf_random_depth_update_equals_reference(tmp_path: Path) -> None:
    schedule = gg.schedules.RandomDepth(N, low=1, high=N, seed=1)
    depths = [schedule.plan(s).depth for s in range(STEPS)]
    assert len(set(depths)) > 1, depths
    model, trainer, recorder = train(schedule, tmp_path)
    check_steps(schedule, recorder)
    check_logs(schedule, trainer, model)
    assert all(p.requires_grad for p in model.parameters())


def test_hf_lisa_update_equals_reference(tmp_path: Path) -> None:
    schedule = gg.schedules.LISA(
        N, k=1, every=1, always=["transformer.wte"], embeddings=False, seed=3
    )
    drawn = [schedule.plan(s).learning(N) for s in range(STEPS)]
    assert len(set(drawn)) > 1, drawn
    model, trainer, recorder = train(schedule, tmp_path)
    check_steps(schedule, recorder)
    check_logs(schedule, trainer, model)
    # the position embedding runs after the named token embedding and is not named: no update
    first = recorder.steps[0]["before"]["transformer.wpe.weight"]
    assert torch.equal(model.transformer.wpe.weight, first)


def test_hf_dropbp_update_equals_reference(tmp_path: Path) -> None:
    schedule = gg.schedules.DropBP(N, 0.5, seed=1)
    skips = [schedule.plan(s).skip for s in range(STEPS)]
    assert any(skips) and len(set(skips)) > 1, skips
    model, trainer, recorder = train(schedule, tmp_path)
    check_steps(schedule, recorder)
    check_logs(schedule, trainer, model)


def test_hf_reference_check_fails_on_a_wrong_learning_rate(tmp_path: Path) -> None:
    """The comparison is not vacuous: the same run checked against lr * 1.01 fails."""
    schedule = gg.schedules.LISA(
        N, k=1, every=1, always=["transformer.wte"], embeddings=False, seed=3
    )
    _, _, recorder = train(schedule, tmp_path)
    with pytest.raises(AssertionError):
        check_steps(schedule, recorder, lr=LR * 1.01)
