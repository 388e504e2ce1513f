"""Real architectures at tiny sizes, each with an input batch and a scalar loss.

Every factory returns ``(model, batch, loss_fn)`` where ``loss_fn(model, batch)`` runs the
forward and returns a scalar. Random initialisation only: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

Factory = Callable[[], tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]]
VOCAB = 97


def _token_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (2, 12), generator=generator)}


def _lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**batch).logits
    return logits.float().pow(2).mean() + logits[..., 0].mean()


def gpt2(*, tied: bool = False, layers: int = 3) -> tuple[nn.Module, Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        tie_word_embeddings=tied,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval(), _token_batch(), _lm_loss


def bert(*, layers: int = 3) -> tuple[nn.Module, Any, Any]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).eval(), _token_batch(), _lm_loss


def llama(*, layers: int = 3) -> tuple[nn.Module, Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        use_cache=False,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval(), _token_batch(), _lm_loss


def _sum_of_squares(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def cnn_with_batchnorm() -> tuple[nn.Module, Any, Any]:
    """A CNN made of three stages (conv, BatchNorm, ReLU) and a head, in train mode."""

    def stage(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, stride=2),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    torch.manual_seed(0)
    model = nn.Sequential(
        stage(3, 8),
        stage(8, 8),
        stage(8, 16),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5)),
    )
    return model.train(), torch.randn(4, 3, 16, 16), _sum_of_squares


class LongSkipNet(nn.Module):
    """A U-Net-like stack: block ``i`` feeds block ``n-1-i`` through a long skip."""

    def __init__(self, width: int = 8, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Linear(5, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        saved = []
        n = len(self.blocks)
        for i, block in enumerate(self.blocks):
            if i >= n // 2:
                h = h + saved[n - 1 - i]
            h = block(h)
            saved.append(h)
        return self.head(h)


def long_skip() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    return LongSkipNet(), torch.randn(4, 5), _sum_of_squares


def conv_stack(n: int = 10) -> tuple[nn.Module, Any, Any]:
    """The seeds' stack of ``n`` Conv2d(3, 3, 3) layers."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Conv2d(3, 3, 3) for _ in range(n)])
    return model, torch.randn(2, 3, 24, 24), lambda m, x: m(x).mean()


REAL_MODELS: dict[str, Factory] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "cnn_bn": cnn_with_batchnorm,
    "long_skip": long_skip,
}


class Tokens(Dataset):
    """A small fixed data set of token sequences for language-model trainers (labels = ids)."""

    def __init__(self, count: int = 16, length: int = 8, vocab: int = 64) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(tmp_path: Any, **options: Any) -> Any:
    """HF ``TrainingArguments`` for a quiet CPU run in ``tmp_path``: no reports, no saves (unless
    ``options`` set ``save_strategy``), no progress bar; ``options`` are the rest."""
    import transformers

    quiet = {
        "output_dir": str(tmp_path),
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(**{**quiet, **options})


def lightning_trainer(tmp_path: Any, **options: Any) -> Any:
    """A Lightning ``Trainer`` for a quiet CPU run in ``tmp_path``: no logger (unless ``options``
    give one), no checkpoints, no progress bar or model summary; ``options`` are the rest."""
    import lightning

    quiet = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    return lightning.Trainer(**{**quiet, **options})


def tiny_llama(layers: int) -> nn.Module:
    """A random-init Llama LM of ``layers`` blocks, vocabulary 64, width 16 (seed 0)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(layers: int) -> nn.Module:
    """A random-init GPT-2 LM of ``layers`` blocks, vocabulary 64, no dropout (seed 0)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions with BatchNorm, and a 1x1
    projection on the residual when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class TinyResNet(nn.Module):
    """torchvision's ResNet-18 layout at a tiny width: a stem, four stages (``layer1`` to
    ``layer4``, the blocks) of two basic blocks, average pooling and a linear head ``fc``."""

    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        widths = [width, 2 * width, 4 * width, 8 * width]
        cin = width
        for i, cout in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(
                self,
                f"layer{i + 1}",
                nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)),
            )
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # type: ignore[operator]
        out: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


def tiny_resnet() -> tuple[nn.Module, Any, Any]:
    """A torchvision-style ResNet backbone in eval mode (BatchNorm uses its running statistics),
    a batch of 4 images of 16 x 16, and a cross-entropy loss."""
    torch.manual_seed(0)
    model = TinyResNet().eval()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        target = torch.arange(batch.shape[0]) % 5
        return nn.functional.cross_entropy(model(batch), target)

    return model, images, loss
