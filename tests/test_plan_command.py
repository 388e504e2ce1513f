"""``gradgate plan CONFIG.json``: a transformers config planned on the meta device, for CUDA.

Each test writes a tiny config and reads the command's output; the figures are compared with
``gg.estimate`` on the same model, planned the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gradgate as gg
from gradgate import cli
from gradgate._memory.memory_plan import format_bytes

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 64,
    "torch_dtype": "bfloat16",
}
LLAMA2 = {**LLAMA, "num_hidden_layers": 2}
LLAMA2 = {**LLAMA, "num_hidden_layers": 2}
T5 = {"model_type": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
      "num_decoder_layers": 2, "num_heads": 4, "vocab_size": 100}  # fmt: skip
BART = {"model_type": "bart", "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64, "vocab_size": 100, "max_position_embeddings": 64}  # fmt: skip
VIT = {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
       "intermediate_size": 64, "image_size": 32, "patch_size": 8}  # fmt: skip
HEADER = ["depth", "params", "grads", "optimizer", "saved", "other", "peak", "phase"]


def plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any],
         *options: str) -> tuple[int, str, str]:  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    status = cli.main(["plan", str(path), "--batch", "2", *options])
    out, err = capsys.readouterr()
    return status, out, err


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows by label (the first cell: up to two spaces)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == HEADER) + 2
    found = {}
    for line in lines[start:]:
        if "  " not in line:  # the notes under the table
            break
        label, _, rest = line.partition("  ")
        found[label.strip()] = rest.split()
    return found


def meta_llama(tmp_path: Path, config: dict[str, Any] = LLAMA) -> Any:
    from transformers import AutoConfig, LlamaForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        return LlamaForCausalLM(AutoConfig.from_pretrained(str(tmp_path))).train()


def test_memory_plans_every_depth_around_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Depth 3 is not one of 0, 1, 2, 4: with a budget between its peak and depth 4's, the
    answer is 3 (it used to be 2), and the table shows the row that proves it."""
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    reference = gg.estimate(meta_llama(tmp_path), input_ids=ids, labels=ids, dtype="bf16",
                            depths=[3, 4], device="cuda")  # fmt: skip
    room = [row.peak_bytes + reference.headroom_for(row) for row in reference.rows]
    budget = f"{sum(room) // 2}B"
    status, out, err = plan(tmp_path, capsys, LLAMA, "--seq", "16", "--memory", budget)
    assert (status, err) == (0, ""), err
    assert out.splitlines()[0].startswith("LlamaForCausalLM: memory of one training step")
    assert "bfloat16" in out and "planned for cuda" in out
    table = rows(out)
    assert list(table) == ["0", "1", "2", "3", "4 (all blocks)", "full fine-tune"]
    assert (
        " ".join(table["3"][10:])
        == f"{format_bytes(reference[3].peak_bytes)} {reference[3].peak_phase}"
    )
    assert (
        f"largest depth that fits in {budget} (peak + headroom: 512 MiB + 5% of the peak): 3" in out
    )
    assert "all blocks: what runs before the first block (the embeddings) stays frozen" in out
    assert "full fine-tune: no cut, every parameter learns, embeddings included" in out
    assert "a full fine-tune does not fit" in out


def test_depth_lists_ranges_and_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--depths", "0-0,2")
    assert status == 0 and list(rows(out)) == ["0", "2 (all blocks)", "full fine-tune"]
    status, out, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--depths", "all")
    assert status == 0 and list(rows(out)) == ["0", "1", "2 (all blocks)", "full fine-tune"]
    for bad, message in [("x", "is not a list of depths"), ("0-9", "out of range")]:
        status, _, err = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--depths", bad)
        assert status != 0 and err.count("\n") == 1 and message in err, err


def test_learn_embeddings_adds_them_to_every_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--depths", "0,2",
                          "--learn-embeddings")  # fmt: skip
    table = rows(out)
    assert status == 0 and list(table) == ["0 + embeddings", "2 (all blocks) + embeddings",
                                          "full fine-tune"]  # fmt: skip
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    reference = gg.estimate(
        meta_llama(tmp_path, LLAMA2), input_ids=ids, labels=ids, dtype="bf16", depths=[0],
        learn=[{"model.embed_tokens"}], device="cuda",
    )  # fmt: skip
    with_embedding = reference.rows[1].grad_bytes
    assert with_embedding == reference[0].grad_bytes + 300 * 64 * 2  # bf16
    assert " ".join(table["0 + embeddings"][2:4]) == format_bytes(with_embedding)
    assert table["2 (all blocks) + embeddings"][:12] == table["full fine-tune"][:12]


@pytest.mark.parametrize(
    ("config", "options", "blocks"),
    [(T5, ["--seq", "8"], 4), (VIT, [], 2),
     pytest.param(BART, ["--seq", "8"], 4, marks=pytest.mark.slow),
     pytest.param(T5, ["--seq", "8", "--blocks", "decoder.block.*"], 2, marks=pytest.mark.slow)],
    ids=["t5", "vit", "bart", "t5-decoder"],
)  # fmt: skip
def test_encoder_decoder_and_vision_configs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    config: dict[str, Any],
    options: list[str],
    blocks: int,
) -> None:
    status, out, err = plan(tmp_path, capsys, config, *options)
    assert (status, err) == (0, ""), err
    assert f"({blocks} blocks," in out.splitlines()[0]
    assert f"{blocks} (all blocks)" in rows(out)


@pytest.mark.slow
def test_amp_checkpointing_and_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, plain, _ = plan(tmp_path, capsys, LLAMA, "--seq", "16", "--depths", "4")
    _, amp, _ = plan(tmp_path, capsys, LLAMA, "--seq", "16", "--depths", "4", "--amp", "bf16")
    assert "float32, autocast bfloat16" in amp.splitlines()[0]
    _, ckpt, _ = plan(tmp_path, capsys, LLAMA, "--seq", "16", "--depths", "4",
                      "--checkpointing")  # fmt: skip
    saved = [rows(out)["4 (all blocks)"][6:8] for out in (plain, ckpt)]  # checkpoints saved
    assert saved[0] != saved[1]
    _, sgd, _ = plan(tmp_path, capsys, LLAMA, "--seq", "16", "--depths", "4", "--optimizer", "sgd")
    assert "optimizer sgd" in sgd and rows(sgd)["4 (all blocks)"][4:6] == ["0", "B"]
    _, masters, _ = plan(
        tmp_path, capsys, LLAMA, "--seq", "16", "--depths", "1", "--masters", "fp32"
    )
    assert "bfloat16, fp32 masters" in masters.splitlines()[0]
    status, _, err = plan(
        tmp_path, capsys, LLAMA, "--seq", "16", "--amp", "bf16", "--masters", "fp32"
    )
    assert status != 0 and "--dtype bf16 --masters fp32" in err and err.count("\n") == 1
    status, _, err = plan(
        tmp_path, capsys, LLAMA, "--seq", "16", "--amp", "bf16", "--dtype", "bf16"
    )
    assert status == 2 and "not allowed with argument" in err and err.count("\n") == 1


def test_a_sequence_longer_than_the_positions_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = plan(tmp_path, capsys, LLAMA, "--seq", "65")
    assert status != 0 and out == "" and err.count("\n") == 1
    assert "--seq 65 is longer" in err and "max_position_embeddings=64" in err
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100,
            "n_positions": 32}  # fmt: skip
    status, _, err = plan(tmp_path, capsys, gpt2, "--seq", "4096")
    assert status != 0 and "max_position_embeddings=32" in err and "--seq 32 or less" in err


def test_unknown_model_types_and_missing_files_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = plan(tmp_path, capsys, {"model_type": "lama"}, "--seq", "8")
    assert status != 0 and err.count("\n") == 1 and len(err) < 300, err
    assert "model_type 'lama' is not one transformers knows; did you mean 'llama'" in err
    status = cli.main(["plan", str(tmp_path / "missing.json"), "--batch", "1", "--seq", "8"])
    err = capsys.readouterr().err
    assert status != 0 and err.count("\n") == 1 and "missing.json" in err
    status, _, err = plan(tmp_path, capsys, LLAMA)
    assert status != 0 and "expected --seq S" in err


def frozen_head_llama(tmp_path: Path, config: dict[str, Any] = LLAMA) -> Any:
    model = meta_llama(tmp_path, config)
    model.lm_head.requires_grad_(False)
    return model


def cells(row: gg.MemoryRow) -> list[str]:
    """A row's cells as the table prints them, split on spaces."""
    sizes = (row.param_bytes, row.grad_bytes, row.optimizer_bytes, row.saved_bytes,
             row.other_bytes, row.peak_bytes)  # fmt: skip
    return " ".join([*map(format_bytes, sizes), row.peak_phase or ""]).split()


def test_learn_and_freeze_plan_what_the_api_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--learn 0 --learn 0,1 --freeze lm_head: the rows of gg.estimate(learn=[{0}, {0, 1}])
    on the model with its head frozen, and the verdict says what learns in each."""
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    reference = gg.estimate(frozen_head_llama(tmp_path), input_ids=ids, labels=ids, dtype="bf16",
                            learn=[{0}, {0, 1}], masters="fp32", device="cuda")  # fmt: skip
    status, out, err = plan(tmp_path, capsys, LLAMA, "--seq", "16", "--learn", "0", "--learn",
                            "0,1", "--freeze", "lm_head", "--masters", "fp32", "--memory",
                            "1GiB")  # fmt: skip
    assert (status, err) == (0, ""), err
    table = rows(out)
    assert list(table) == ["learn {0}", "learn {0, 1}", "full fine-tune"]
    assert table["learn {0}"] == cells(reference[{0}])
    assert table["learn {0, 1}"] == cells(reference[{0, 1}])
    assert "frozen in every row: lm_head" in out
    assert "full fine-tune: no cut, every parameter learns but the frozen ones" in out
    how = "in 1GiB (peak + headroom: 512 MiB + 5% of the peak)"
    assert f"learn {{0}} fits {how}: " in out
    assert "where model.layers.0 and model.norm learn" in out
    assert "where model.layers.0-1 and model.norm learn" in out
    assert "where model.embed_tokens, model.layers.0-3 and model.norm learn" in out
    assert "depth" not in out.split("frozen in every row")[1]  # no depth row was planned


def test_badam_is_block_0_with_the_head_frozen_and_fp32_masters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, badam, err = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--badam")
    assert (status, err) == (0, ""), err
    assert "bfloat16, fp32 masters" in badam.splitlines()[0]
    _, by_hand, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--learn", "0", "--freeze",
                         "lm_head", "--masters", "fp32")  # fmt: skip
    assert rows(badam) == rows(by_hand) and next(iter(rows(badam))) == "learn {0}"
    _, without, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--badam", "--masters", "none")
    assert "masters" not in without.splitlines()[0]
    _, depths, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--badam", "--learn", "1",
                        "--depths", "1")  # fmt: skip
    assert list(rows(depths)) == ["1", "learn {1}", "full fine-tune"]
    status, _, err = plan(tmp_path, capsys, {**LLAMA2, "torch_dtype": "float32"}, "--seq", "8",
                          "--badam")  # fmt: skip
    assert status == 1 and err.count("\n") == 1
    assert "--badam plans float32 masters of low-precision weights, but the planned weights " \
           "are float32" in err  # fmt: skip
    assert "pass --dtype bf16" in err and "--masters none" in err and "dtype='" not in err


@pytest.mark.slow
def test_the_8b_badam_plan_of_full_finetune_md(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/full-finetune.md's table from the command line: Llama-3-8B, 1 x 2048, bf16 with
    fp32 masters, checkpointing, block 0 learning and the head frozen: 20.88 GiB, as the API
    plans it. About 25 s of CPU (the command's two rows, the API's one), more on a busy machine."""
    import transformers

    eight_b = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
               "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
               "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(eight_b))
    status = cli.main(["plan", str(path), "--batch", "1", "--seq", "2048", "--memory", "24GiB",
                       "--dtype", "bf16", "--checkpointing", "--badam"])  # fmt: skip
    out, err = capsys.readouterr()
    assert (status, err) == (0, ""), err
    table = rows(out)
    assert " ".join(table["learn {0}"]) == (
        "14.96 GiB 416.02 MiB 2.44 GiB 1.53 GiB 1.96 GiB 20.88 GiB backward"
    )
    assert "learn {0} fits in 24GiB (peak + headroom: 512 MiB + 5% of the peak): 22.42 GiB, " \
           "where model.layers.0 and model.norm learn" in out  # fmt: skip
    page = (Path(__file__).parents[1] / "docs" / "depth-fits.md").read_text(encoding="utf-8")
    shown = page.split("--checkpointing --badam\n```\n\n```text\n")[1].split("```")[0]
    assert out.strip() == shown.strip()  # the page shows what the command prints
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.23
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    model.lm_head.requires_grad_(False)
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    api = gg.estimate(model.train(), input_ids=ids, labels=ids, learn=[{0}], masters="fp32")
    assert table["learn {0}"] == cells(api.rows[0])


def test_a_flag_means_only_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No abbreviations: --learn was --learn-embeddings, --check was --checkpointing."""
    for flag in ("--learn-emb", "--check", "--mem=1GiB"):
        status, _, err = plan(tmp_path, capsys, LLAMA2, "--seq", "8", flag)
        assert status == 2 and f"unrecognized arguments: {flag}" in err, err
    status, out, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--learn", "1")
    assert status == 0 and list(rows(out)) == ["learn {1}", "full fine-tune"]
    status = cli.main(["demo", "--epoch", "1"])
    assert status == 2 and "unrecognized arguments: --epoch" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "words", "status"),
    [(["--dtype", "bfloat"], "argument --dtype: 'bfloat' is not a dtype; did you mean "
      "bfloat16? expected bf16, fp16 or fp32", 2),
     (["--dtype", "fp32", "--masters", "fp32"], "--masters fp32 keeps float32 masters of "
      "low-precision weights, but the planned weights are float32 (--dtype fp32); pass --dtype "
      "bf16 (or fp16) for bf16 weights with fp32 masters, or --amp bf16 without --masters", 1),
     (["--depths", "0,99"], "--depths 99 is out of range: the model has 4 blocks; expected "
      "depths in 0..4, e.g. --depths 0-4 or --depths all", 1),
     (["--depths", "2-9"], "--depths 2-9 is out of range", 1),
     (["--batch", "-1"], "argument --batch: '-1' is not a whole number >= 1; expected the "
      "batch size, e.g. --batch 8", 2),
     (["--seq", "0"], "argument --seq: '0' is not a whole number >= 1; expected the sequence "
      "length, e.g. --seq 2048", 2),
     (["--memory", "24 gigs"], "--memory '24 gigs' is not a size", 1),
     (["--memory", "24GiB", "--headroom", "10%"], "--headroom '10%' is not a size", 1),
     (["--learn", "0,9"], "--learn 0,9: block 9 is out of range: the model has 4 blocks; "
      "expected positions 0..3", 1),
     (["--learn", "0,model.nrom"], "--learn 0,model.nrom: 'model.nrom' matches no module of "
      "LlamaForCausalLM; did you mean 'model.norm'?", 1),
     (["--freeze", "lm_hed"], "--freeze 'lm_hed' matches no module of LlamaForCausalLM; did "
      "you mean 'lm_head'?", 1),
     (["--learn", "0,,1"], "argument --learn: '0,,1' has an empty item", 2)],
    ids=["dtype", "masters", "depths", "depth-range", "batch", "seq", "memory", "headroom",
         "learn-position", "learn-name", "freeze", "learn-empty"],
)  # fmt: skip
def test_errors_are_worded_as_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], words: str,
    status: int,
) -> None:  # fmt: skip
    config = {**LLAMA, "torch_dtype": "float32"} if "--masters" in options else LLAMA
    if "--batch" in options:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        found = cli.main(["plan", str(path), "--seq", "8", *options])
        err = capsys.readouterr().err
    else:
        found, _, err = plan(tmp_path, capsys, config, "--seq", "8", *options)
    assert found == status and err.count("\n") == 1, err
    assert words in err, err
    assert "gg." not in err and "='" not in err and "e.g. 2048" not in err.replace("--seq", "")


def test_seq_on_a_vision_config_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(gg.GradgateWarning, match=r"--seq 128 is ignored: a vision config takes "
                      r"its image size from the config \(image_size=32\)"):  # fmt: skip
        status, with_seq, _ = plan(tmp_path, capsys, VIT, "--seq", "128", "--depths", "2")
    _, without, _ = plan(tmp_path, capsys, VIT, "--depths", "2")
    assert status == 0 and with_seq == without


def test_when_no_depth_fits_the_verdict_names_the_learning_head(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's 8B command without --badam: the head learns at every depth, and that is
    what does not fit; the verdict says so, and how to freeze it."""
    status, out, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--memory", "100KiB",
                          "--headroom", "0")  # fmt: skip
    assert status == 0
    assert "no depth fits in 100KiB (peak + headroom 0 B): the smallest is" in out
    assert "(depth 0, where model.norm and lm_head learn)" in out
    assert "lm_head learns at every depth: --freeze lm_head (or --badam) plans it frozen" in out
    _, frozen, _ = plan(tmp_path, capsys, LLAMA2, "--seq", "8", "--memory", "100KiB",
                        "--headroom", "0", "--freeze", "lm_head")  # fmt: skip
    assert "(depth 0, where model.norm learn" in frozen and "--freeze lm_head (or" not in frozen


def test_gpus_and_shard_plan_one_gpu_of_several(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--gpus 4 --shard fsdp2: each row is one GPU's bytes, as gg.estimate(world=4,
    shard='fsdp2') plans them; the title says so."""
    status, out, _ = plan(
        tmp_path, capsys, LLAMA, "--seq", "32", "--depths", "1,4", "--gpus", "4", "--shard",
        "fsdp2", "--masters", "fp32", "--memory", "24MiB", "--headroom", "0",
    )  # fmt: skip
    assert status == 0
    assert "per rank: fsdp2 over 4 ranks" in out
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    model = meta_llama(tmp_path)
    want = gg.estimate(
        model, input_ids=ids, labels=ids, depths=[1, 4], dtype="bf16", masters="fp32",
        world=4, shard="fsdp2", device="cuda",
    )  # fmt: skip
    found = rows(out)
    for depth in (1, 4):
        row = want[depth]
        shown = " ".join(found["4 (all blocks)" if depth == 4 else str(depth)])
        assert shown.startswith(" ".join(map(format_bytes, row._figures()[:3])))
        assert shown.endswith(f"{format_bytes(row.peak_bytes)} {row.peak_phase}")
    assert "fits in 24MiB" in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--gpus", "0"], "'0' is not a whole number >= 1; expected the number of GPUs"),
        (["--gpus", "two"], "'two' is not a whole number >= 1"),
        (["--shard", "fsdp2"], "--shard fsdp2 divides the step among GPUs, but --gpus is 1"),
        (["--gpus", "4"], "--gpus 4 needs to know how the GPUs divide the model; expected --shard"),
        (["--gpus", "4", "--shard", "fsdp"], "invalid choice: 'fsdp'"),
        (["--gpus", "2", "--shard", "ddp", "--deepspeed", "ds.json"], "--deepspeed ds.json"),
    ],
)
def test_gpus_and_shard_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    status, out, err = plan(tmp_path, capsys, LLAMA2, "--seq", "8", *options)
    assert status != 0 and out == "" and message in err, err
    assert err.count("\n") in (1, 2), err  # argparse adds its usage line


def test_a_deepspeed_config_sets_zeros_buckets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reduce bucket of a DeepSpeed config ('auto': hidden_size squared, as the HF Trainer
    fills it) is in every ZeRO row: 2 x 64 x 64 bytes of bf16 here, not DeepSpeed's default
    of 5e8 elements."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}))
    options = ["--seq", "8", "--depths", "1", "--gpus", "2", "--shard", "zero3"]
    status, small, _ = plan(tmp_path, capsys, LLAMA2, *options, "--deepspeed", str(ds))
    assert status == 0
    status, default, _ = plan(tmp_path, capsys, LLAMA2, *options)
    assert status == 0
    small_row, default_row = rows(small)["1"], rows(default)["1"]
    assert small_row[:2] == default_row[:2]  # the same parameters per GPU
    # other: DeepSpeed's default bucket, 5e8 bf16 elements (953.67 MiB), or 64 x 64 of them
    assert float(default_row[8]) > 953 and default_row[9] == "MiB" and small_row[9] == "KiB"


@pytest.mark.slow
def test_a_70b_badam_run_is_planned_per_gpu_in_a_minute() -> None:
    """'Does a Llama-3-70B BAdam run fit 4 x 80 GB at 1 x 2048?' answered from the docs'
    config in under a minute of CPU: yes with FSDP2, the parts each GPU's shard."""
    import resource
    import subprocess
    import sys

    root = Path(gg.__file__).parents[2]
    command = [
        sys.executable, "-m", "gradgate", "plan", str(root / "docs/configs/llama3-70b.json"),
        "--batch", "1", "--seq", "2048", "--badam", "--checkpointing", "--gpus", "4",
        "--shard", "fsdp2", "--memory", "80GB",
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(gg.__file__).parents[1])}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 60
    assert "per rank: fsdp2 over 4 ranks" in done.stdout
    assert "learn {0} fits in 80GB per GPU (4 GPUs, fsdp2)" in done.stdout
    badam = rows(done.stdout)["learn {0}"]
    assert badam[:6] == ["32.85", "GiB", "408.01", "MiB", "2.39", "GiB"]
