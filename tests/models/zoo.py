"""A zoo of real architectures at tiny sizes for the cut: stacks that run skipped, twice, in
another order, or as two stacks. Each entry builds ``(model, batch(seed), loss_fn)``; random
initialisation only, nothing downloaded. Dropout is off so a seeded step is reproducible, while
LayerDrop stays on where the architecture has it (it is what the cut must follow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 61


@dataclass
class Entry:
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Any]]
    loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor]
    blocks: list[str] | None  # None: gg.blocks finds them; else the blocks= to pass
    after: list[str]  # modules that run after the last block: they learn at every depth


def _ids(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _logits_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    out = model(**batch)
    logits = out.logits if hasattr(out, "logits") else out
    return logits.double().pow(2).mean() + logits[..., 0].double().mean()


def _tokens(seed: int) -> dict[str, Any]:
    return {"input_ids": _ids(seed)}


def _seq2seq(seed: int) -> dict[str, Any]:
    return {"input_ids": _ids(seed), "decoder_input_ids": _ids(seed + 1000, 7)}


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.3,
        decoder_layerdrop=0.3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return BartForConditionalGeneration(config)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return T5ForConditionalGeneration(config)


def albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    config = AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=8,
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=24,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=32,
    )
    return AlbertForMaskedLM(config)


def clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 32,
    }
    vision = {
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 8,
    }
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))


def _clip_batch(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": _ids(seed, 6),
        "pixel_values": torch.randn(2, 3, 16, 16, generator=generator),
    }


def _clip_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    out = model(**batch)
    return out.logits_per_image.double().pow(2).mean() + out.text_embeds.double().sum()


def wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.3,
        mask_time_prob=0.0,
    )
    return Wav2Vec2ForCTC(config)


def whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_source_positions=8,
        max_target_positions=16,
        dropout=0.0,
        encoder_layerdrop=0.4,
        decoder_layerdrop=0.4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=[],
        begin_suppress_tokens=[],
    )
    return WhisperForConditionalGeneration(config)


def _mels(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_features": torch.randn(2, 8, 16, generator=generator),
        "decoder_input_ids": _ids(seed + 1000, 5),
    }


def _decoder_only(kind: str) -> Callable[[], nn.Module]:
    """A tiny causal LM of one of transformers' decoder-only families."""

    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, f"{kind}Config")(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
            head_dim=8,
            tie_word_embeddings=False,
        )
        return getattr(transformers, f"{kind}ForCausalLM")(config)

    return build


def roberta() -> nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    config = RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=40,
        tie_word_embeddings=False,
    )
    return RobertaForMaskedLM(config)


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=24,
        image_size=16,
        patch_size=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ViTForImageClassification(config)


def _pixels(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator)}


def _audio(seed: int) -> dict[str, Any]:
    return {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(seed))}


class LayerDropMLP(nn.Module):
    """Residual blocks skipped at random in training, like BART/Wav2Vec2's LayerDrop."""

    def __init__(self, n: int = 5, p: float = 0.4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n))
        self.head = nn.Linear(8, 1)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            if self.training and torch.rand(()) < self.p:
                continue
            h = h + layer(h)
        return self.head(h)


class SharedLayer(nn.Module):
    """One layer called several times per forward (ALBERT, universal transformers)."""

    def __init__(self, calls: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layer = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.other = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(self.calls):
            h = self.layer(h)
        return self.head(self.other(h))


class Reversed(nn.Module):
    """Blocks run last-registered first."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(n))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return self.head(x)


class TwoTowers(nn.Module):
    """Image tower runs first but is registered second; a tied embedding is registered last."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.image = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.image:
            x = block(x)
        for block in self.text:
            y = block(y + x)
        return self.head(y)


def _vector(seed: int) -> dict[str, Any]:
    return {"x": torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))}


def _vector6(seed: int) -> dict[str, Any]:
    return {"x": torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))}


def _towers(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(3, 6, generator=generator),
        "y": torch.randn(3, 6, generator=generator),
    }


def _sum_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).double().pow(2).sum()


ZOO: dict[str, Entry] = {
    "bart": Entry(
        bart,
        _seq2seq,
        _logits_loss,
        ["model.encoder.layers.*", "model.decoder.layers.*"],
        ["lm_head"],
    ),
    "t5": Entry(
        t5,
        _seq2seq,
        _logits_loss,
        ["encoder.block.*", "decoder.block.*"],
        ["decoder.final_layer_norm", "lm_head"],
    ),
    "albert": Entry(
        albert, _tokens, _logits_loss, ["albert.encoder.albert_layer_groups.0"], ["predictions"]
    ),
    "clip": Entry(
        clip,
        _clip_batch,
        _clip_loss,
        ["vision_model.encoder.layers.*", "text_model.encoder.layers.*"],
        ["text_model.final_layer_norm", "text_projection"],
    ),
    "whisper": Entry(
        whisper,
        _mels,
        _logits_loss,
        ["model.encoder.layers.*", "model.decoder.layers.*"],
        ["model.decoder.layer_norm", "proj_out"],
    ),
    "wav2vec2": Entry(wav2vec2, _audio, _logits_loss, None, ["lm_head"]),
    **{
        kind.lower(): Entry(_decoder_only(kind), _tokens, _logits_loss, None, ["lm_head"])
        for kind in ["Llama", "Mistral", "Qwen2", "Gemma"]
    },
    "roberta": Entry(roberta, _tokens, _logits_loss, None, ["lm_head"]),
    "vit": Entry(vit, _pixels, _logits_loss, None, ["classifier"]),
    "layerdrop_mlp": Entry(LayerDropMLP, _vector, _sum_loss, None, ["head"]),
    "shared_layer": Entry(SharedLayer, _vector, _sum_loss, ["layer"], ["other", "head"]),
    "reversed": Entry(Reversed, _vector6, _sum_loss, None, ["head"]),
    "two_towers": Entry(TwoTowers, _towers, _sum_loss, ["image.*", "text.*"], ["head"]),
}
