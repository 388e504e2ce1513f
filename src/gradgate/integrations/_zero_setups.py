"""Which DeepSpeed set-ups ``step_learners_only`` takes, and why not the others.

The DeepSpeed optimizer behind an engine (or the HF Trainer's wrapper), the kind of step it
takes (ZeRO 1/2, ZeRO-3, or a plain torch optimizer at stage 0), and every refusal with its
reason and what works instead. deepspeed is imported only inside these functions.
"""

from __future__ import annotations

from typing import Any

import torch

from .._plumbing.errors import InvalidOptionError
from .._tools.masters import LearnerMasters

WORKS = "ZeRO stage 1, 2 or 3 with a torch optimizer and no optimizer offload"
KNOBS = (
    '"bf16": {"enabled": true, "bf16_master_weights_and_grads": true, '
    '"bf16_optimizer_states": true}'
)


def deepspeed_optimizer(engine: Any) -> Any:
    """The DeepSpeed optimizer behind an engine, an accelerate wrapper, or itself."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    found = engine
    if isinstance(found, DeepSpeedEngine) or type(found).__name__ == "DeepSpeedOptimizerWrapper":
        found = found.optimizer  # the second: accelerate's, in the HF Trainer
    if not type(found).__module__.startswith(("deepspeed.", "torch.optim", "gradgate.")):
        raise InvalidOptionError(
            f"engine={engine!r:.80}; expected what deepspeed.initialize returned (the engine or "
            "its optimizer), built with an optimizer: pass optimizer=torch.optim.AdamW(...) or "
            'an "optimizer" section in the config.'
        )
    return found


def kind_of(outer: Any) -> tuple[str, torch.optim.Optimizer]:
    """``"zero12"``, ``"zero3"`` or ``"plain"``, and the torch optimizer that steps."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(outer, DeepSpeedZeroOptimizer):
        stage = 2 if outer.partition_gradients else 1
        refuse(outer.cpu_offload, stage, "offload_optimizer (its CPU step is not split)")
        refuse(outer.elastic_checkpoint, stage, "elastic_checkpoint (it saves flat state)")
        kind = "zero12"
    elif isinstance(outer, DeepSpeedZeroOptimizer_Stage3):
        stage = 3
        refuse(outer.offload_optimizer, stage, "offload_optimizer (its CPU step is not split)")
        kind = "zero3"
    elif isinstance(outer, torch.optim.Optimizer):
        return "plain", outer
    elif type(outer).__name__ == "BF16_Optimizer":
        raise InvalidOptionError(
            "bf16 with ZeRO stage 1 and data_types.grad_accum_dtype fp32 runs DeepSpeed's "
            "BF16_Optimizer, which steps one flat fp32 copy that gradgate cannot split; "
            f"expected {WORKS}: leave grad_accum_dtype out, or use stage 2."
        )
    else:
        raise InvalidOptionError(
            f"{type(outer).__name__} (ZeRO stage 0 with fp16 or bf16) steps one flat fp32 copy "
            f"that gradgate cannot split; expected {WORKS}: set zero_optimization.stage to 1."
        )
    refuse(bool(getattr(outer, "zenflow", False)), stage, "zenflow")
    refuse(bool(getattr(outer, "use_muon", False)), stage, "Muon (not element-wise)")
    base = outer.optimizer
    refuse(isinstance(base, torch.optim.Adagrad), stage, "Adagrad (state made eagerly)")
    if not isinstance(base, torch.optim.Optimizer):
        raise InvalidOptionError(
            f"the optimizer {type(base).__name__} under ZeRO stage {stage} is no "
            f"torch.optim.Optimizer; expected {WORKS}."
        )
    return kind, base


def refuse(present: bool, stage: int, what: str) -> None:
    if present:
        raise InvalidOptionError(
            f"ZeRO stage {stage} with {what} cannot step only the parameters that learn; "
            f"expected {WORKS}: turn it off in the DeepSpeed config."
        )


def check_masters(outer: Any, kind: str, flats: list[torch.Tensor]) -> None:
    """LearnerMasters holds the masters only where ZeRO keeps none: its flat partitions must
    be in the parameters' own dtype (bf16 with DeepSpeed's two bf16 options, or float32)."""
    if kind == "plain":
        return  # stage 0 in fp32: the engine steps LearnerMasters over the model's parameters
    stage = 3 if kind == "zero3" else 2 if outer.partition_gradients else 1
    groups = outer.fp16_groups if kind == "zero3" else outer.bit16_groups
    weights = next((p.dtype for group in groups for p in group), torch.float32)
    kept = next((flat.dtype for flat in flats), weights)
    if weights == torch.float16:
        raise InvalidOptionError(
            f"gg.optim.LearnerMasters under ZeRO stage {stage} with fp16 weights: ZeRO keeps an "
            "fp32 master of every parameter unless fp16_master_weights_and_gradients, which it "
            "allows only with offload_optimizer and DeepSpeedCPUAdam; expected bf16 weights: "
            f"{KNOBS} in the config."
        )
    if kept != weights:
        raise InvalidOptionError(
            f"gg.optim.LearnerMasters under ZeRO stage {stage}: ZeRO keeps a {kept} master of "
            f"every {weights} parameter, so a gradgate plan would save no master memory; "
            f"expected ZeRO to keep none: {KNOBS} in the DeepSpeed config"
            f"{_knobs_missing()} (LearnerMasters then holds fp32 masters and state only for "
            "the learners' stretches)."
        )
    if kind == "zero3" and getattr(outer, "offload_param", False):
        raise InvalidOptionError(
            "gg.optim.LearnerMasters under ZeRO stage 3 with offload_param: the partitions "
            "then live in CPU memory and ZeRO keeps its own copy of each for the optimizer on "
            "the accelerator (2 bytes a parameter), so offloading saves nothing; expected "
            "zero_optimization without offload_param (gradgate then points that copy at the "
            "partitions themselves), or more ranks."
        )


def _knobs_missing() -> str:
    """A note when this DeepSpeed has no bf16_master_weights_and_grads option."""
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    except ImportError:
        fields: Any = {}
    else:
        fields = getattr(DeepSpeedBF16Config, "model_fields", {})
    if "bf16_master_weights_and_grads" in fields:
        return ""
    return (
        " (this DeepSpeed has no such option: it came in DeepSpeed 0.18.3; upgrade, or keep "
        "torch.optim.AdamW with step_learners_only(engine, keep_state=False): AdamW state only "
        "for the learners, ZeRO's masters for every parameter)"
    )


def keep_given_masters(trainer: Any) -> None:
    """Keep the LearnerMasters (and its scheduler) given to a Hugging Face Trainer that runs
    DeepSpeed.

    transformers' DeepSpeed set-up drops ``optimizers=(optimizer, scheduler)`` and builds an
    AdamW and a scheduler of its own from the arguments: with DeepSpeed's bf16 options set for
    LearnerMasters, that AdamW would step bf16 masters and moments of every parameter, with no
    word said. The Trainer's ``create_optimizer`` and ``create_scheduler`` (on this Trainer
    only) put the given ones back when that set-up has dropped them.
    """
    given, scheduler = trainer.optimizer, trainer.lr_scheduler
    if not getattr(trainer, "is_deepspeed_enabled", False) or not isinstance(given, LearnerMasters):
        return
    create_optimizer, create_scheduler = trainer.create_optimizer, trainer.create_scheduler

    def keep_optimizer(*args: Any, **kwargs: Any) -> Any:
        if trainer.optimizer is None:
            trainer.optimizer = given
        return create_optimizer(*args, **kwargs)

    def keep_scheduler(*args: Any, **kwargs: Any) -> Any:
        if trainer.lr_scheduler is None and scheduler is not None:
            trainer.lr_scheduler = scheduler
        return create_scheduler(*args, **kwargs)

    trainer.create_optimizer = keep_optimizer
    trainer.create_scheduler = keep_scheduler
