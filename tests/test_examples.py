"""Every example runs and prints its claims as true."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

CLAIMS = {
    "intermediate_gradient.py": [
        "plain autograd, .grad of the intermediate y: None",
        "equals torch.autograd.grad: True",
        "parameters trained in the same backward: True",
    ],
    "inplace_error.py": [
        "raised: SavedTensorModifiedError",
        "saved by MulBackward0: op 'mul' in module 'gain'",
        "modified in place by op '__setitem__'",
        "Fix: do not change the tensor in place",
        "original PyTorch error kept: True",
        "after the fix, weight grad: [5.0, 6.0, 7.0]",
    ],
    "backward_twice.py": [
        "raised: GraphFreedError",
        "already used: AddmmBackward0: op 'linear' in module '0'",
        "retain_graph and a second forward agree: True",
    ],
    "finetune_replaced_head.py": [
        "trainable parameters: ['5.weight', '5.bias']",
        "backbone bit-identical after 3 steps: True",
        "BatchNorm running statistics unchanged: True",
        "frozen .grad are None: True",
        "head changed: True",
        "gg.check findings: []",
    ],
    "x_then_y.py": [
        "without no_grad or freeze, X's wgrad is computed and wasted: True",
        "gg.check flags it: True",
        "Y's gradients equal in all four ways: True",
        "no_grad, freeze and cut compute the same backward: True",
        "X's .grad stays None after the cut: True",
        "Y update audit: X wgrad=0 dgrad=0",
    ],
    "detach_nograd_inference.py": [
        "detach records the prefix graph, the others do not: True",
        "suffix gradients identical: True",
        "inference tensor without clone: InferenceTensorError",
    ],
    "ddpg_actor_critic.py": [
        "critic update: actor .grad all None: True",
        "critic update: actor weights bit-identical: True",
        "critic update audit: actor wgrad=0 dgrad=0",
        "critic update costs exactly the ideal: True",
        "actor update: critic .grad all None: True",
        "actor update: actor gets gradients through the critic: True",
        "actor update: critic weights bit-identical: True",
    ],
    "manual_gradient_manipulation.py": [
        "encoder gradient zeroed per step: [True, False, True, False]",
        "identical to the hand-written loop: True",
    ],
    "dropbp_gpt2.py": [
        "gradients equal the hand-written DropBP reference: True",
        "3 of 6 blocks skipped: backward FLOPs",
    ],
    "lisa_llama.py": [
        "only the drawn layers moved, the others bit-identical: True",
        "layers with AdamW state after each step: [[1], [], [2], [], [3], []]",
        "embeddings learn: True",
        "backward FLOPs of a LISA step vs full backprop:",
    ],
    "gradual_unfreeze_lightning.py": [
        "depth logged per optimizer step: [1, 1, 2, 2, 3, 3, 4, 4]",
        "matches the schedule: True",
        "blocks outside the suffix bit-identical: True",
    ],
}
# Examples that build a transformers or Lightning model take seconds: run by CI, skipped by
# the quick run `python -m pytest -m "not slow"`.
SLOW = {"dropbp_gpt2.py", "lisa_llama.py", "gradual_unfreeze_lightning.py"}


def test_every_example_is_tested() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(CLAIMS)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
        for name in sorted(CLAIMS)
    ],
)
def test_example_prints_its_claims(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    printed = capsys.readouterr().out
    for claim in CLAIMS[name]:
        assert claim in printed, f"{name} did not print {claim!r}:\n{printed}"
