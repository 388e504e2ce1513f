"""What LearnerMasters holds, counted by a live-bytes counter (tests/live_bytes.py: it follows
storages), not by the optimizer's own report, on a scaled-down bf16 Llama with BAdam (one layer
a block, lm_head frozen as BAdam leaves it)."""

from __future__ import annotations

import pytest
import torch
from live_bytes import LiveBytes

import gradgate as gg
import gradgate._tools.masters as masters_module

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:transformers.*")
LAYERS, K = 4, 2


def scaled_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.lm_head.requires_grad_(False)
    return model


def measured_steps(steps: int, *, drop: bool) -> tuple[list[dict[str, int]], torch.nn.Module]:
    """Per step: bytes kept across it, the step's peak above what was live when it began, and
    (with drop_finished) the bytes that drop freed."""
    model = scaled_llama()
    gate = gg.BackpropGate(model)
    sched = gg.schedules.BAdam(LAYERS, K, order="ascending")
    learning = [p for p in model.parameters() if p.requires_grad]
    opt = gg.optim.LearnerMasters(torch.optim.AdamW, learning, lr=1e-3, foreach=False)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    found = []
    with LiveBytes(model, opt) as counter:
        for t in range(steps):
            sched.apply(gate, t)
            start = counter.live
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            counter.reset_peak()
            before_step = counter.live
            opt.step()
            step_peak = counter.peak - before_step
            opt.zero_grad()
            kept = counter.live - start
            before_drop = counter.live
            if drop:
                gg.optim.drop_finished(opt, gate, sched, t + 1)
            found.append({"kept": kept, "step": step_peak, "dropped": before_drop - counter.live})
    gate.remove()
    return found, model


def sizes(model: torch.nn.Module) -> tuple[int, int, int]:
    """Elements of a layer plus the final norm (what learns), its tensors, the largest one."""
    layer = list(model.model.layers[0].parameters()) + list(model.model.norm.parameters())
    return sum(p.numel() for p in layer), len(layer), max(p.numel() for p in layer)


@pytest.fixture
def one_chunk_per_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    """No chunk floor: each parameter of this small model is stepped on its own, as the large
    ones of a full-size model are."""
    monkeypatch.setattr(masters_module, "_CHUNK_FLOOR", 0)


def test_the_first_step_of_a_block_makes_12_bytes_a_parameter_and_later_steps_none() -> None:
    found, model = measured_steps(2 * LAYERS, drop=False)
    learners, tensors, _ = sizes(model)
    made = 12 * learners + 4 * tensors  # master + exp_avg + exp_avg_sq, and a step counter
    assert found[0]["kept"] == made
    # later steps of the block make nothing; at a switch the old block goes before the new one
    # is made (layers are the same size, so nothing changes)
    assert [step["kept"] for step in found[1:]] == [0] * (2 * LAYERS - 1)


def test_step_temporaries_stay_within_12_bytes_of_the_largest_learner(
    one_chunk_per_parameter: None,
) -> None:
    found, model = measured_steps(2 * LAYERS, drop=False)
    learners, tensors, largest = sizes(model)
    first_step = 12 * learners + 4 * tensors
    # state made parameter by parameter, with the fp32 gradient, sqrt and quotient of one
    assert first_step < found[0]["step"] <= first_step + 12 * largest
    # every later step, switches included: nothing doubled, one parameter's temporaries
    assert max(step["step"] for step in found[1:]) == 12 * largest
    assert 12 * largest < 12 * learners  # a whole block's state would show


def test_one_chunk_for_a_small_model_holds_its_fp32_gradients_together() -> None:
    found, model = measured_steps(3, drop=False)
    learners, _, largest = sizes(model)
    # all fp32 gradients at once (4 bytes each), and AdamW's loop keeps the last quotient
    # while it makes the next parameter's square root and quotient
    assert max(step["step"] for step in found[1:]) <= 4 * learners + 12 * largest


def test_drop_finished_frees_the_block_before_the_next_backward() -> None:
    found, model = measured_steps(2 * LAYERS, drop=True)
    learners, tensors, _ = sizes(model)
    norm = model.model.norm.weight.numel()
    block = 12 * (learners - norm) + 4 * (tensors - 1)  # the final norm learns at every step
    assert [step["dropped"] for step in found] == [0, block] * LAYERS
    assert [step["kept"] for step in found] == [12 * learners + 4 * tensors, 0] + [
        block,
        0,
    ] * (LAYERS - 1)


def test_the_plan_holds_the_bytes_the_counter_measured() -> None:
    found, model = measured_steps(1, drop=False)
    ids = torch.randint(0, 128, (2, 16))
    plan = gg.estimate(model, input_ids=ids, labels=ids, learn=[{0}], masters="fp32", device="cpu")
    assert plan.rows[0].optimizer_bytes == found[0]["kept"]
