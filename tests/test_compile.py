"""torch.compile of gated models: eager-equal gradients at every depth, <= 3 graphs."""

from __future__ import annotations

import copy
from contextlib import ExitStack, nullcontext
from typing import Any

import pytest
import torch
from models import tiny_gpt2, trainer_args
from torch import nn

import gradgate as gg
from gradgate._bench.compiled import compile_counts, schedule
from gradgate._plumbing import torch_internals as internals
from gradgate._plumbing.frames_compile import COMPILED_MARK
from gradgate._plumbing.hooks import CompiledForward

BACKEND = "aot_eager"  # dynamo's guards and graphs do not depend on the backend; this is fast


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).tanh()


class Gate(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(x).chunk(2, dim=-1)
        return x + a * b.sigmoid()


class Net(nn.Module):
    """Blocks of two classes, alternating, between an embedding and a head."""

    def __init__(self, n: int = 6, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.blocks = nn.ModuleList(Mlp(d) if i % 2 == 0 else Gate(d) for i in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_gradients_equal_eager_after_every_depth_change() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Net()
    compiled = copy.deepcopy(eager)
    x = torch.randn(4, 5, 3)
    start = counters["stats"]["unique_graphs"]
    n = len(eager.blocks)
    warm, rest = schedule(n)
    warm.append(n - 1)  # the warm-up puts each block class once first after the cut
    with (
        gg.BackpropGate(eager, "blocks.*") as eager_gate,
        gg.compile_blocks(compiled, "blocks.*", backend=BACKEND),
        gg.BackpropGate(compiled, "blocks.*") as compiled_gate,
    ):
        for step, depth in enumerate(warm + rest):
            if step == len(warm):
                after_warm_up = counters["stats"]["unique_graphs"]
            eager_gate.depth = compiled_gate.depth = depth
            for model in (eager, compiled):
                model.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
            expected, got = _grads(eager), _grads(compiled)
            for name, grad in expected.items():
                if grad is None:
                    assert got[name] is None, (depth, name)
                else:
                    torch.testing.assert_close(got[name], grad, msg=f"{name} at {depth}")
    graphs = counters["stats"]["unique_graphs"] - start
    assert graphs <= 3 * 2  # two block classes
    assert counters["stats"]["unique_graphs"] == after_warm_up  # no recompiles after warm-up


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("method", ["gradgate+compile", "gate+torch.compile"])
def test_bench_counts_three_graphs_and_no_recompiles(method: str) -> None:
    row = compile_counts(method, backend=BACKEND, size="tiny", n=4)
    assert row["graphs"] <= 3
    assert row["recompiles"] == 0
    assert row["recompile_limit_hits"] == 0


def test_handle_restores_the_original_forwards() -> None:
    net = Net(n=2)
    before = {name: vars(block).get("forward") for name, block in net.blocks.named_children()}
    handle = gg.compile_blocks(net, "blocks.*", backend=BACKEND)
    assert all("forward" in vars(block) for block in net.blocks)
    with pytest.raises(gg.InvalidOptionError, match=r"already compiled by gg\.compile_blocks"):
        gg.compile_blocks(net, "blocks.*", backend=BACKEND)
    handle.remove()
    handle.remove()
    after = {name: vars(block).get("forward") for name, block in net.blocks.named_children()}
    assert before == after == {"0": None, "1": None}
    assert net.blocks[0].forward.__func__ is Mlp.forward


def test_nothing_selected_is_a_clear_error() -> None:
    with pytest.raises(gg.UnknownModuleError, match=r"blocks=\[\] names no block"):
        gg.compile_blocks(Net(n=2), [], backend=BACKEND)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x).tanh()


def _assert_same_grads(eager: nn.Module, model: nn.Module, depth: int | None) -> None:
    pairs = zip(eager.named_parameters(), model.parameters(), strict=True)
    for (name, want), got in pairs:
        if want.grad is None:
            assert got.grad is None, (depth, name)
        else:
            torch.testing.assert_close(got.grad, want.grad, msg=f"{name} at {depth}")


def _whole_model_run(
    eager: nn.Module, blocks: object, call: Any, backend: str, wrap: Any = None
) -> tuple[int, int, dict[str, int], list[str]]:
    """torch.compile(model) of a gated copy of ``eager`` over every depth, twice; gradients
    against the gated eager model after each step. ``call(net)`` is the loss.

    Returns the graphs after the first pass, after both, dynamo's graph-break reasons and the
    warnings raised.
    """
    import warnings

    from torch._dynamo.utils import counters

    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with (
        warnings.catch_warnings(record=True) as caught,
        gg.BackpropGate(eager, blocks) as eager_gate,
        gg.BackpropGate(model, blocks) as gate,
    ):
        warnings.simplefilter("always")
        plain = eager if wrap is None else wrap(eager)
        compiled = torch.compile(model if wrap is None else wrap(model), backend=backend)
        for _ in range(2):
            for depth in [None, *range(len(gate.blocks) + 1), None]:
                eager_gate.depth = gate.depth = depth
                for net, run in ((eager, plain), (model, compiled)):
                    net.zero_grad(set_to_none=True)
                    call(run).backward()
                _assert_same_grads(eager, model, depth)
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs[0], graphs[1], dict(counters["graph_break"]), [str(w.message) for w in caught]


def _sequential(n: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), *[Block(8) for _ in range(n)], nn.Linear(8, 2))


def _sequential_loss(run: Any) -> torch.Tensor:
    return run(torch.ones(4, 3)).pow(2).mean()


# the gate's hooks, by design (torch 2.6 words it "call torch._dynamo.disable() wrapped ...")
_OPAQUE = ("Skip calling `torch.compiler.disable()`d function", "call torch._dynamo.disable()")


def _compiled_per_block(first: int, total: int, breaks: dict[str, int], most: int = 3) -> None:
    """No graph after the first pass over all depths and no graph break; where torch cannot skip
    the gate's frames (2.6, 2.7), the gated forward runs eagerly instead: only the gate's own
    breaks (the gradients are compared by the caller either way)."""
    assert total == first <= most
    if internals.SKIPS_FRAMES:
        assert breaks == {}
    else:
        assert breaks and all(reason.startswith(_OPAQUE) for reason in breaks), breaks


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_whole_model_compile_three_graphs_no_breaks_no_recompiles(backend: str) -> None:
    """Each block's forward is compiled as a frame of its own, the gate runs eagerly around it:
    one graph per grad state (prefix, first after the cut, suffix), at every depth."""
    blocks = [str(i) for i in range(1, 5)]
    first, total, breaks, caught = _whole_model_run(
        _sequential(), blocks, _sequential_loss, backend
    )
    _compiled_per_block(first, total, breaks)
    assert caught == []


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_whole_model_compile_of_a_transformers_gpt2() -> None:
    ids = torch.arange(24).reshape(2, 12) % 64

    def loss(run: Any) -> torch.Tensor:
        return run(ids, labels=ids, use_cache=False).loss

    first, total, breaks, caught = _whole_model_run(tiny_gpt2(4), "transformer.h.*", loss, "eager")
    _compiled_per_block(first, total, breaks)
    assert all("a parameter shared by" in message for message in caught)  # the tied embedding


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_whole_model_compile_keeps_the_fused_encoder_layer_exact() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    model, x = nn.Sequential(encoder, nn.Linear(8, 1)), torch.randn(2, 5, 8)
    first, total, breaks, _ = _whole_model_run(
        model, "0.layers.*", lambda run: run(x).pow(2).mean(), "eager"
    )
    assert total > 0 or not internals.SKIPS_FRAMES  # torch.nn's own forwards are compiled too
    _compiled_per_block(first, total, breaks)


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_whole_model_compile_of_blocks_made_of_torch_nn_containers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(4)])
    first, total, breaks, caught = _whole_model_run(
        nn.Sequential(model, nn.Linear(3, 1)), "0.*", _sequential_loss, "eager"
    )
    assert total > 0 or not internals.SKIPS_FRAMES
    _compiled_per_block(first, total, breaks)
    assert caught == []


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).tanh()


@pytest.mark.slow  # a subprocess or a compile: seconds
def test_gated_model_inside_a_compiled_module_breaks_once_at_its_root() -> None:
    blocks = [str(i) for i in range(1, 5)]
    first, total, breaks, caught = _whole_model_run(
        _sequential(), blocks, _sequential_loss, "eager", wrap=Outer
    )
    assert total == first <= 3 + 2  # the blocks' graphs, Outer's before and after the gated root
    assert list(breaks) == [reason for reason in breaks if reason.startswith(_OPAQUE)]
    assert caught == []


def test_compile_after_the_gate_is_removed_sees_a_plain_model() -> None:
    model = _sequential()
    with gg.BackpropGate(model, [str(i) for i in range(1, 5)]) as gate:
        gate.depth = 1
        torch.compile(model, backend="eager")(torch.ones(4, 3)).sum().backward()
        forwards = [vars(block).get("forward") for block in list(model)[1:5]]
        compiled_by_block = all(isinstance(f, CompiledForward) for f in forwards)
        assert compiled_by_block == internals.SKIPS_FRAMES  # else eager (torch 2.6, 2.7)
    assert all("forward" not in vars(module) for module in model)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(model, backend="eager")(torch.ones(4, 3)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_hf_trainer_torch_compile_trains_like_eager(tmp_path) -> None:
    """Trainer(torch_compile=True) with a random depth every step: the same weights as the
    eager run, 3 graphs, no graph break."""
    pytest.importorskip("accelerate")
    import transformers
    from models import Tokens
    from torch._dynamo.utils import counters

    def train(compile: bool) -> dict[str, torch.Tensor]:
        model = tiny_gpt2(4)
        schedule = gg.schedules.RandomDepth(4, low=0, high=4, seed=5)
        args = trainer_args(
            tmp_path,
            max_steps=8,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            seed=0,
            torch_compile=compile,
            torch_compile_backend="eager" if compile else None,
        )
        callback = gg.integrations.transformers.GateCallback(schedule)
        transformers.Trainer(
            model=model, args=args, train_dataset=Tokens(), callbacks=[callback]
        ).train()
        assert len({schedule.plan(step).depth for step in range(8)}) >= 4
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    eager = train(compile=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(compile=True)
    breaks = dict(counters["graph_break"])
    _compiled_per_block(
        counters["stats"]["unique_graphs"], counters["stats"]["unique_graphs"], breaks
    )
    for name, weight in eager.items():
        torch.testing.assert_close(compiled[name], weight, msg=name)


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("how", ["compile_blocks", "torch.compile"])
def test_a_hook_inside_one_block_is_not_lost_to_a_shared_graph(how: str) -> None:
    """The blocks of a class share their graphs; a learning set naming a module inside one block
    hooks that module only. Dynamo's default skips the guards on such hooks, so the block would
    run the graph its class compiled first, without the hook, and that module would not learn."""
    blocks = [str(i) for i in range(1, 5)]
    eager = _sequential()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    with (
        gg.BackpropGate(eager, blocks) as eager_gate,
        gg.BackpropGate(model, blocks) as gate,
        gg.compile_blocks(model, blocks, backend="eager")
        if how == "compile_blocks"
        else nullcontext(),
    ):
        run = torch.compile(model, backend="eager") if how == "torch.compile" else model
        for learn in ([3], ["2.fc", 3], [3], ["1.fc", "3.fc"]):
            eager_gate.learn = gate.learn = learn
            for net, call in ((eager, eager), (model, run)):
                net.zero_grad(set_to_none=True)
                _sequential_loss(call).backward()
            _assert_same_grads(eager, model, None)
            assert (model[2].fc.weight.grad is not None) == ("2.fc" in learn)


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("root", ["own class", "nn.Sequential"])
def test_compiled_before_the_gate_exists(root: str) -> None:
    """torch.compile wraps a torch.nn container's call when it is compiled (docs: gate first)."""
    from torch._dynamo.utils import counters

    eager = _sequential() if root == "nn.Sequential" else Outer(_sequential())
    model = copy.deepcopy(eager)
    blocks = [str(i) for i in range(1, 5)]
    blocks = blocks if root == "nn.Sequential" else [f"inner.{b}" for b in blocks]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    with gg.BackpropGate(eager, blocks) as eager_gate, gg.BackpropGate(model, blocks) as gate:
        for depth in [None, 0, 4, 1, 2, 3]:
            eager_gate.depth = gate.depth = depth
            for net, run in ((eager, eager), (model, compiled)):
                net.zero_grad(set_to_none=True)
                _sequential_loss(run).backward()
            _assert_same_grads(eager, model, depth)
    breaks = dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 3
    if root == "nn.Sequential" or not internals.SKIPS_FRAMES:
        assert list(breaks) == [reason for reason in breaks if reason.startswith(_OPAQUE)]
        assert sum(breaks.values()) >= 1
        assert sum(breaks.values()) == 1 or not internals.SKIPS_FRAMES
    else:
        assert breaks == {}


# depths, learning sets (naming a module inside a block too) and skips, before and after the cut
_MIXED_PLANS: list[dict[str, Any]] = [
    {"depth": None},
    {"depth": 0},
    {"depth": 4},
    {"depth": 2},
    {"learn": {1}},
    {"learn": {"blocks.3.fc", 3}},
    {"depth": 3, "skip": {2}},
    {"learn": {1, 3}, "skip": {3}},
    {"depth": None, "skip": {1}},
    {"depth": 2, "skip": {0}},
    {"learn": {"blocks.1.fc"}},
    {"learn": {"blocks.2.norm", 3}},
]


def _set_plan(gate: gg.BackpropGate, plan: dict[str, Any]) -> None:
    gate.skip = set()
    if "learn" in plan:
        gate.learn = plan["learn"]
    else:
        gate.depth = plan["depth"]
    gate.skip = plan.get("skip", set())


def _graphs_per_pass(
    how: str, plans: list[dict[str, Any]], sizes: list[list[int]], **compile_kwargs: Any
) -> list[int]:
    """Unique graphs after each pass over ``plans`` on :class:`Net` (two block classes; pass
    ``i`` runs plan ``j`` at batch size ``sizes[i][j % len(sizes[i])]``), gradients against the
    gated eager model at every step. ``how``: ``compile_blocks`` before the gate, after it
    (``gate, compile_blocks``), or ``torch.compile`` of the gated model."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = Net(n=4)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    with ExitStack() as stack:
        if how == "compile_blocks":
            stack.enter_context(gg.compile_blocks(model, backend="eager", **compile_kwargs))
        eager_gate = stack.enter_context(gg.BackpropGate(eager, "blocks.*"))
        gate = stack.enter_context(gg.BackpropGate(model, "blocks.*"))
        if how == "gate, compile_blocks":
            stack.enter_context(gg.compile_blocks(model, backend="eager", **compile_kwargs))
        whole = how == "torch.compile"
        run = torch.compile(model, backend="eager", **compile_kwargs) if whole else model
        for batch_sizes in sizes:
            for step, plan in enumerate(plans):
                _set_plan(eager_gate, plan)
                _set_plan(gate, plan)
                x = torch.ones(batch_sizes[step % len(batch_sizes)], 5, 3)
                for net, call in ((eager, eager), (model, run)):
                    net.zero_grad(set_to_none=True)
                    call(x).pow(2).mean().backward()
                _assert_same_grads(eager, model, step)
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs


_HOWS = ["compile_blocks", "gate, compile_blocks", "torch.compile"]


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("how", _HOWS)
def test_mixed_plans_compile_nothing_in_a_second_pass(how: str) -> None:
    """After one pass over the plans, nothing compiles: each block class runs in at most five
    states (before the cut; first learner; learning after it; frozen after it, under a learning
    set; skipped after the cut), a graph each. Three causes of new graphs in a second pass,
    gone: a skipped block's first call after the cut kept its graph (the residual check), its
    later calls not, so their state first compiled in the second pass (no check now where the
    block runs compiled); a block holding a module named in the learning set broke its graph
    at that module's hook, and dynamo guards the first half only on what ran before the break,
    so later calls in the same state, hooked or not, ran the halves and compiled the second
    half anew (such a block runs eagerly now); ``compile_blocks`` after the gate compiled the
    gate's wrapper, its hooks graph breaks (it compiles the block's own forward beneath now)."""
    expected = 5 + 5 if internals.SKIPS_FRAMES or how != "torch.compile" else 0
    assert _graphs_per_pass(how, _MIXED_PLANS, [[4], [4]]) == [expected, expected]


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("how", _HOWS)
def test_a_batch_size_that_changes_compiles_each_state_once_more_unless_dynamic(how: str) -> None:
    """Dynamo (``dynamic=None``) compiles a block's graphs static until its forward meets a
    second size; each static graph compiles once more, dynamic, when its state meets another
    size, and a size after that compiles nothing. ``dynamic=True``: dynamic graphs from the
    start (dynamo compiles Mlp's twice in two of its states, settling a guard on its input's
    ``.grad``), and no size from 2 on compiles anything after the warm-up."""
    plans = [{"depth": 0}, {"depth": 4}, {"depth": 2}, {"learn": {1, 3}}]  # Mlp 4, Gate 3 states
    sizes = [[4], [6], [5]]
    if how == "torch.compile" and not internals.SKIPS_FRAMES:  # the gated forward runs eagerly
        assert _graphs_per_pass(how, plans, sizes) == [0, 0, 0]
        return
    assert _graphs_per_pass(how, plans, sizes) == [7, 7 + 7, 7 + 7]
    dynamic = _graphs_per_pass(how, plans, [[4], [6], [5, 3]], dynamic=True)
    assert dynamic == [dynamic[0]] * 3 and 7 <= dynamic[0] <= 9


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("how", ["torch.compile", "compile_blocks"])
def test_a_transformers_cache_in_compiled_blocks_says_pass_use_cache_false(how: str) -> None:
    """A DynamicCache made inside the forward (``use_cache`` left at its default) reaches each
    block, and dynamo guards on its per-layer state: a graph per layer and state, until dynamo's
    recompile limit, whose message names grad mode. gradgate names the cause and the fix."""
    import warnings

    model = tiny_gpt2(2)
    ids = torch.arange(24).reshape(2, 12) % 64
    torch._dynamo.reset()
    with (
        warnings.catch_warnings(record=True) as caught,
        gg.compile_blocks(model, "transformer.h.*", backend="eager")
        if how == "compile_blocks"
        else nullcontext(),
        gg.BackpropGate(model, "transformer.h.*") as gate,
    ):
        warnings.simplefilter("always")
        run = torch.compile(model, backend="eager") if how == "torch.compile" else model
        gate.depth = 1
        run(ids, labels=ids, use_cache=False).loss.backward()
        with torch.no_grad():  # generation-like: no graph, the cache wanted
            run(ids)
        assert [w for w in caught if "use_cache" in str(w.message)] == []
        run(ids, labels=ids).loss.backward()  # the config's use_cache=True
        run(ids, labels=ids).loss.backward()
    about_cache = [w for w in caught if "use_cache" in str(w.message)]
    assert [w.category for w in about_cache] == [gg.GradgateWarning]  # once, for all blocks
    message = str(about_cache[0].message)
    assert "a transformers DynamicCache reaches the compiled block GPT2Block" in message
    assert "pass `use_cache=False`" in message
    assert "names grad mode" in message  # what dynamo's own message blames
    assert about_cache[0].filename == __file__  # the user's line


@pytest.mark.slow  # a subprocess or a compile: seconds
@pytest.mark.parametrize("first", ["compile_blocks", "gate"])
@pytest.mark.parametrize("removed_first", ["compile_blocks", "gate"])
def test_compile_blocks_and_a_gate_made_and_removed_in_any_order(
    first: str, removed_first: str
) -> None:
    """The gate's hooks stay out of the compiled code in either order, and removing either
    leaves the other working: the gate cutting, the blocks compiled."""
    from torch._dynamo.utils import counters

    blocks = [str(i) for i in range(1, 5)]
    eager = _sequential()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    made = {}
    for kind in [first, "gate" if first == "compile_blocks" else "compile_blocks"]:
        made[kind] = (
            gg.compile_blocks(model, blocks, backend="eager")
            if kind == "compile_blocks"
            else gg.BackpropGate(model, blocks, depth=2)
        )
    with gg.BackpropGate(eager, blocks, depth=2):
        for net in (eager, model):
            _sequential_loss(net).backward()
        _assert_same_grads(eager, model, 2)
        assert dict(counters["graph_break"]) == {}  # no hook inside a graph
        made[removed_first].remove()
        for net in (eager, model):
            net.zero_grad(set_to_none=True)
            _sequential_loss(net).backward()
        if removed_first == "compile_blocks":  # the gate still cuts
            _assert_same_grads(eager, model, 2)
    if removed_first == "gate":  # the blocks still compiled
        assert all(getattr(vars(model[i]).get("forward"), COMPILED_MARK) for i in range(1, 5))
        assert model[1].fc.weight.grad is not None  # no cut left
    made["gate" if removed_first == "compile_blocks" else "compile_blocks"].remove()
    assert all("forward" not in vars(module) for module in model)
