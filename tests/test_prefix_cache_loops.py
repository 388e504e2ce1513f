"""gg.PrefixCache in the loops people use: the HF Trainer and Lightning callbacks with a keyed
dataset, schedules that move the cut, and DDP (each rank caches its own samples)."""

from __future__ import annotations

import copy
import importlib.util
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import Tokens, gpt2, lightning_trainer, trainer_args
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import gradgate as gg

LAYERS = 4


def _same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


# -- the HF Trainer ------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning:transformers.*")
@pytest.mark.filterwarnings("ignore::UserWarning:accelerate.*", "ignore::UserWarning:torch.*")
def test_the_hf_trainer_with_a_keyed_dataset(tmp_path: Path) -> None:
    import transformers

    from gradgate.integrations.transformers import GateCallback

    def train(model: nn.Module, cache: gg.PrefixCache | None) -> transformers.Trainer:
        schedule = gg.schedules.GradualUnfreeze(LAYERS, every=10**6, start=1)  # depth 1
        data: Any = Tokens()
        if cache is None:
            callback = GateCallback(schedule)
        else:
            callback = GateCallback(schedule, cache=cache)
            data = gg.PrefixCache.keyed(data)
        args = trainer_args(
            tmp_path, num_train_epochs=3, per_device_train_batch_size=4, learning_rate=1e-2,
            logging_steps=1, seed=0, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[callback]
        )
        trainer.train()
        return trainer

    model, _, _ = gpt2(layers=LAYERS)
    reference = copy.deepcopy(model)
    plain = train(reference, None)
    cache = gg.PrefixCache(gg.BackpropGate(model), check=0.0)
    cached = train(model, cache)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, cached)]
    assert losses[0] == losses[1] and len(losses[0]) == 12
    _same_parameters(reference, model)
    assert (cache.stats.hits, cache.stats.misses) == (32, 16)  # epochs 2 and 3 from the cache


# -- Lightning -----------------------------------------------------------------------------------
class Vectors(Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(16, 3, generator=generator),
            torch.randn(16, 2, generator=generator),
        )

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 8),
        *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(LAYERS)],
        nn.Linear(8, 2),
    )


def _lightning_module(net: nn.Module) -> Any:
    import lightning

    class Regress(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return (self.net(batch["x"]) - batch["y"]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regress()


@pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)
def test_the_lightning_callback_takes_the_keys_from_the_batch(tmp_path: Path) -> None:
    from gradgate.integrations.lightning import GateCallback

    def fit(net: nn.Module, cache: gg.PrefixCache | None) -> None:
        schedule = gg.schedules.GradualUnfreeze(LAYERS, every=10**6, start=1)
        data: Any = Vectors()
        if cache is None:
            callback = GateCallback(
                schedule, gg.BackpropGate(net, [f"{i}" for i in range(1, LAYERS + 1)])
            )
        else:
            callback = GateCallback(schedule, cache=cache)
            data = gg.PrefixCache.keyed(data)
        trainer = lightning_trainer(tmp_path, max_epochs=3, callbacks=[callback])
        trainer.fit(_lightning_module(net), DataLoader(data, batch_size=4))

    reference, net = _net(), _net()
    fit(reference, None)
    cache = gg.PrefixCache(gg.BackpropGate(net, [f"{i}" for i in range(1, LAYERS + 1)]), check=0.0)
    fit(net, cache)
    _same_parameters(reference, net)
    assert (cache.stats.hits, cache.stats.misses) == (32, 16)


def test_the_callbacks_check_the_cache() -> None:
    pytest.importorskip("lightning")
    from gradgate.integrations.lightning import GateCallback

    net = _net()
    gate = gg.BackpropGate(net, [f"{i}" for i in range(1, LAYERS + 1)])
    cache = gg.PrefixCache(gate)
    schedule = gg.schedules.GradualUnfreeze(LAYERS, every=10)
    assert GateCallback(schedule, cache=cache).gate is gate
    with pytest.raises(gg.InvalidOptionError, match=r"cache=.*expected a gg\.PrefixCache"):
        GateCallback(schedule, cache="yes")  # type: ignore[arg-type]
    other = gg.BackpropGate(_net(), [f"{i}" for i in range(1, LAYERS + 1)])
    with pytest.raises(gg.InvalidOptionError, match="the cache's gate"):
        GateCallback(schedule, other, cache=cache)
    with pytest.raises(gg.InvalidOptionError, match="model='net' with cache="):
        GateCallback(schedule, cache=cache, model="net")


# -- schedules that move the cut -----------------------------------------------------------------
X = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))


def _loop(schedule: gg.schedules.Schedule, cached: bool, epochs: int = 4) -> tuple[nn.Module, Any]:
    net = _net()
    gate = gg.BackpropGate(net, [f"{i}" for i in range(1, LAYERS + 1)])
    cache = gg.PrefixCache(gate, check=0.0) if cached else None
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    step = 0
    for _ in range(epochs):
        for keys in ([0, 1, 2, 3], [4, 5, 6, 7]):
            schedule.apply(gate, step)
            optimizer.zero_grad(set_to_none=True)
            if cache is None:
                loss = net(X[keys]).pow(2).sum()
            else:
                with cache.keys(keys):
                    loss = net(X[keys]).pow(2).sum()
            loss.backward()
            optimizer.step()
            step += 1
    return net, cache


def test_gradual_unfreeze_reuses_each_cut_until_it_moves() -> None:
    schedule = gg.schedules.GradualUnfreeze(LAYERS, every=4, start=1)  # a new depth every 2 epochs
    reference, _ = _loop(schedule, False)
    net, cache = _loop(schedule, True)
    _same_parameters(reference, net)
    assert (cache.stats.hits, cache.stats.misses) == (16, 16)  # the second epoch of each depth


def test_lisa_with_random_blocks_mostly_misses() -> None:
    schedule = gg.schedules.LISA(LAYERS, k=1, every=2, embeddings=False, seed=0)
    reference, _ = _loop(schedule, False, epochs=6)
    net, cache = _loop(schedule, True, epochs=6)
    _same_parameters(reference, net)
    stats = cache.stats
    assert stats.hits + stats.misses == 6 * 8 and stats.misses > stats.hits


# -- DDP -----------------------------------------------------------------------------------------
def _ddp_rank(rank: int, store: str, out: str, cached: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    net = _net()
    ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
    gate = gg.BackpropGate(net, [f"{i}" for i in range(1, LAYERS + 1)], depth=1)
    cache = gg.PrefixCache(gate, store="disk", path=f"{out}-cache", check=0.0) if cached else None
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = gg.PrefixCache.keyed(Vectors())
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
    for epoch in range(3):
        sampler.set_epoch(epoch % 1)  # the same samples per rank each epoch
        for batch in DataLoader(data, batch_size=4, sampler=sampler):
            optimizer.zero_grad(set_to_none=True)
            keys = batch.pop("gradgate_key")
            if cache is None:
                loss = (ddp(batch["x"]) - batch["y"]).pow(2).mean()
            else:
                with cache.keys(keys):
                    loss = (ddp(batch["x"]) - batch["y"]).pow(2).mean()
            loss.backward()
            optimizer.step()
    stats = None if cache is None else cache.stats.as_dict()
    torch.save({"params": [p.detach() for p in net.parameters()], "stats": stats}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_under_ddp_each_rank_caches_its_own_samples(tmp_path: Path) -> None:
    results = {}
    for cached in (False, True):
        out = str(tmp_path / f"out-{cached}")
        mp.spawn(
            _ddp_rank, args=(str(tmp_path / f"store-{cached}"), out, cached), nprocs=2, join=True
        )
        results[cached] = [torch.load(f"{out}.{r}") for r in range(2)]
    for rank in range(2):
        for p, q in zip(results[False][rank]["params"], results[True][rank]["params"], strict=True):
            assert torch.equal(p, q)
        stats = results[True][rank]["stats"]
        assert (stats["hits"], stats["misses"], stats["entries"]) == (16, 8, 8)  # its 8 samples
    folders = sorted(p.name for p in (tmp_path / "out-True-cache").iterdir())
    assert folders == ["rank-0", "rank-1"]


@pytest.mark.filterwarnings("ignore::UserWarning:lightning.*", "ignore::UserWarning:torch.*")
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_a_callback_says_when_no_keys_reach_the_model(tmp_path: Path) -> None:
    from gradgate.integrations.lightning import GateCallback

    net = _net()
    cache = gg.PrefixCache(gg.BackpropGate(net, [f"{i}" for i in range(1, LAYERS + 1)]))
    callback = GateCallback(gg.schedules.GradualUnfreeze(LAYERS, every=10), cache=cache)
    trainer = lightning_trainer(tmp_path, max_steps=2, callbacks=[callback])
    with pytest.warns(gg.PrefixCacheWarning, match="no forward of the cached model got keys"):
        trainer.fit(_lightning_module(net), DataLoader(Vectors(), batch_size=4))  # not keyed
    assert cache.stats.misses == 0
