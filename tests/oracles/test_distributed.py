"""Tensor parallelism (DTensor) against no remat: two gloo processes on CPU, a stack of
transformer MLP blocks parallelized colwise / rowwise with dropout on (and with a LayerNorm
under SequenceParallel, the activations sharded along the sequence between blocks); and
FSDP2 x TP on a 2 x 2 mesh of four. remat traces plain tensors only, so each layer runs replayed (as
torch.utils.checkpoint runs it, the policy asked op by op); loss, every local gradient
shard and the random stream after equal no remat bitwise on every rank, under every
built-in policy; and remat.report on each rank says what that rank keeps. Backward runs as
many collectives as without remat (their outputs kept), in replayed layers and in a traced
function region that calls a functional collective. The processes are spawned and joined
by the test."""

from __future__ import annotations

import copy
import functools
import os
import socket
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.models

WORLD = 2
POLICY_NAMES = ["none", "nothing", "everything", "dots", "dots_no_batch", "dots_attention", "budget"]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.down = torch.nn.Linear(16, 8, dtype=torch.float64)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class _NormBlock(_Block):
    """Pre-norm: under SequenceParallel the norm runs on each rank's part of the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(self.norm(x)))))


def _tp_plan(kind: str) -> dict[str, object]:
    """colwise / rowwise ("tp"), or with the norm sequence-parallel ("sp": a block's input
    and output are each rank's part of the sequence, gathered before `up`, scattered after
    `down`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if kind == "tp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


KINDS = {"tp": _Block, "sp": _NormBlock}


def _steps(layers: torch.nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(5)  # the same seed on every rank, as tensor parallel code keeps it
    h = x
    for layer in layers:
        h = layer(h)
    loss = h.pow(2).sum()
    loss.backward()
    return [loss.detach(), *(p.grad.to_local().clone() for p in layers.parameters()), torch.rand(2)]  # type: ignore[union-attr]


def _reports_what_it_keeps(model: torch.nn.ModuleList, x: torch.Tensor, policy_name: str) -> bool:
    """remat.report on this rank, layer by layer: what a layer keeps is this rank's, byte
    for byte the memory its backward graph holds (the garbage collector's count, no remat
    in it); under `dots` the up-projection's kept output is this rank's column shard."""
    from support.kept_memory import bytes_kept_for_backward

    import remat

    agree = True
    for layer in model:
        found = remat.report(layer, x)
        kept = [r for r in found.residuals if r.kind == "intermediate"]
        measured = bytes_kept_for_backward(functools.partial(layer, x.detach().requires_grad_()), runs=2)
        sharded = policy_name != "dots" or any(r.op is torch.ops.aten.addmm.default and r.shape[-1] == 16 // WORLD for r in kept)
        agree &= found.replayed == {layer.forward.region} and sum(r.nbytes for r in kept) == measured and sharded
        with torch.no_grad():
            x = layer(x)
    return agree


_COMMUNICATING = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}


class _Communication(TorchDispatchMode):
    """Counts the collectives that run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.collectives += func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in _COMMUNICATING
        return func(*args, **(kwargs or {}))


def _backward_communicates_as_without_remat(mesh: Any, x: torch.Tensor) -> dict[str, bool]:
    """Sequence parallel, replayed: under every built-in policy (none names collectives)
    backward communicates as much as without remat and no more, the collectives' outputs
    kept; a policy that names them to recompute (`& ~save_ops(COLLECTIVES)`), or a torch
    policy_fn that does not save them, gathers the sequence again. Gradients as without remat either way."""
    from torch.distributed.tensor.parallel import parallelize_module

    import remat
    from remat import policies as P

    def backward_collectives(name: str, policy: Any) -> tuple[int, list[torch.Tensor], bool]:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([_NormBlock() for _ in range(2)])
        for layer in layers:
            parallelize_module(layer, mesh, _tp_plan("sp"))  # type: ignore[arg-type]
        if name != "plain":
            remat.checkpoint_layers(layers, policy)
        torch.manual_seed(5)
        h = x
        for layer in layers:
            h = layer(h)
        counting = _Communication()
        with counting:
            h.pow(2).sum().backward()
        return counting.collectives, [p.grad.to_local() for p in layers.parameters()], True  # type: ignore[union-attr]

    return _communicates_as_plain(backward_collectives, _communication_policies(P.dots_saveable))


def _traced_region_communicates_as_without_remat(x: torch.Tensor) -> dict[str, bool]:
    """A function region that calls a functional collective runs traced, and keeps the
    collective's output as a replayed region does: backward communicates as without remat
    under every built-in policy, more under one that names collectives to recompute; its
    report lists the gathered value as kept."""
    import torch.distributed._functional_collectives as collectives

    import remat
    from remat import policies as P

    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def gathered(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        everyone = collectives.all_gather_tensor(x @ w, 0, list(range(WORLD)))
        return (everyone.sin() @ w.t()).sum(0)

    def backward_collectives(name: str, policy: Any) -> tuple[int, list[torch.Tensor], bool]:
        inputs = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        fn = gathered if name == "plain" else remat.remat(gathered, policy=policy)
        out = fn(*inputs)
        counting = _Communication()
        with counting:
            grads = list(torch.autograd.grad(out.pow(2).sum(), inputs))
        if name == "plain":
            return counting.collectives, grads, True
        residuals = remat.report(fn, *inputs).residuals
        kept = any(r.op is torch.ops._c10d_functional.wait_tensor.default for r in residuals)
        traced = fn.cache_info()["replays"] == 0  # type: ignore[attr-defined]
        return counting.collectives, grads, traced and kept == (name not in RECOMPUTING)

    return _communicates_as_plain(backward_collectives, _communication_policies(P.nothing_saveable))


def _compiled_region_communicates_as_without_remat(x: torch.Tensor) -> dict[str, bool]:
    """Under torch.compile a region is torch's selective checkpoint, its ops tagged by the
    policy (aot_eager: the partitioned graphs run op by op, so their collectives can be
    counted). Backward communicates as the compiled function without remat does under a
    policy that keeps collectives, and more under one that recomputes them (torch's
    partitioner saves collectives only where a region leaves them untagged). Gradients
    bitwise as compiled without remat."""
    import torch.distributed._functional_collectives as collectives

    import remat
    from remat import policies as P

    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def gathered(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        everyone = collectives.all_gather_tensor(x @ w, 0, list(range(WORLD)))
        return (everyone.sin() @ w.t()).sum(0)

    def backward_collectives(name: str, policy: Any) -> tuple[int, list[torch.Tensor], bool]:
        inputs = [x.detach().requires_grad_(), w.detach().requires_grad_()]
        fn = gathered if name == "plain" else remat.remat(gathered, policy=policy)
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
        counting = _Communication()
        with counting:
            grads = list(torch.autograd.grad(out.pow(2).sum(), inputs))
        return counting.collectives, grads, True

    policies = {
        "nothing": P.nothing_saveable,
        RECOMPUTED: P.nothing_saveable & ~P.save_ops(P.COLLECTIVES),
        TORCH_RECOMPUTES: P.from_selective_checkpoint(_prefer_recompute),
        TORCH_SAVES: P.from_selective_checkpoint(_save_collectives),
    }
    return _communicates_as_plain(backward_collectives, policies)


RECOMPUTED = "collectives named, recomputed"
TORCH_RECOMPUTES = "torch policy_fn, PREFER_RECOMPUTE"
TORCH_SAVES = "torch policy_fn saving collectives"
RECOMPUTING = {RECOMPUTED, TORCH_RECOMPUTES}


def _prefer_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_collectives(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    from remat import policies as P

    return CheckpointPolicy.MUST_SAVE if P.op_key(op) in P.COLLECTIVES else CheckpointPolicy.PREFER_RECOMPUTE


def _communication_policies(base: Any) -> dict[str, Any]:
    """The built-in policies, `base` naming collectives to recompute, and torch
    selective-checkpoint policies converted, which decide about collectives as in torch:
    one that recomputes every op (collectives too) and one that saves collectives."""
    from remat import policies as P

    from conftest import BUILT_IN_POLICIES

    return {
        **BUILT_IN_POLICIES,
        RECOMPUTED: base & ~P.save_ops(P.COLLECTIVES),
        TORCH_RECOMPUTES: P.from_selective_checkpoint(_prefer_recompute),
        TORCH_SAVES: P.from_selective_checkpoint(_save_collectives),
    }


def _process_group_calls_replay_as_without_remat(x: torch.Tensor) -> dict[str, bool]:
    """`dist.all_reduce` into a value the policy keeps (a matmul's output) and
    `dist.all_gather_into_tensor` into a buffer: process-group calls a graph cannot hold,
    so the region runs replayed; their writes, which their ops' schemas do not declare, are
    seen (the kept matmul output is recomputed, not reduced twice). Gradients bitwise as
    without remat under every built-in policy; under torch.func.grad, refused naming the op."""
    import remat

    from conftest import BUILT_IN_POLICIES

    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def communicating(x: torch.Tensor) -> torch.Tensor:
        h = (x @ w).detach()
        dist.all_reduce(h)
        gathered = torch.empty(WORLD * x.shape[0], 8, dtype=x.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the name
            dist.all_gather_into_tensor(gathered, h * 2)
        return (h.sin() * x).sum() + (gathered.cos() @ w).sum()

    def gradient(fn: Any) -> torch.Tensor:
        x_ = x.detach().requires_grad_()
        return torch.autograd.grad(fn(x_), x_)[0]

    expected = gradient(communicating)
    outcome = {}
    for name, policy in BUILT_IN_POLICIES.items():
        region = remat.remat(communicating, policy=policy)
        outcome[name] = torch.equal(gradient(region), expected) and region.cache_info()["replays"] == 1
    try:
        torch.func.grad(remat.remat(communicating))(x)
        outcome["refused under grad"] = False
    except remat.RematTraceError as error:
        outcome["refused under grad"] = "c10d.allreduce_" in str(error)
    return outcome


def _refused_under_a_transform(mesh: Any, x: torch.Tensor) -> bool:
    """Under torch.grad a DTensor parameter, or a DTensor argument, is hidden in torch.func's
    plain-looking wrapper; remat looks beneath it and refuses, naming the parameter or
    argument (torch's own error without remat: DTensor's from_local has no setup_context)."""
    from torch.distributed.tensor.parallel import parallelize_module

    import remat

    layer = _Block()
    parallelize_module(layer, mesh, _tp_plan("tp"))  # type: ignore[arg-type]
    region = remat.remat(layer)
    params = dict(layer.named_parameters())
    try:
        torch.func.grad(lambda p: torch.func.functional_call(region, p, (x,)).sum())(params)
        captured = False
    except remat.RematTraceError as error:
        captured = "self.up.weight is a DTensor" in str(error) and "under one it cannot run" in str(error)
    # a DTensor passed as an argument is refused alike (a call of plain tensor arguments
    # takes a shorter path to its cache key)
    weight = layer.up.weight.detach()
    try:
        torch.func.grad(lambda w: remat.remat(_matmul_sum)(x, w))(weight)
        positional = False
    except remat.RematTraceError as error:
        positional = "w is a DTensor" in str(error) and "under one it cannot run" in str(error)
    return captured and positional


def _matmul_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.t()).sum()


def _communicates_as_plain(run: Any, policies: dict[str, Any]) -> dict[str, bool]:
    """For each policy: gradients as without remat, and backward's collectives as many as
    without remat (more under those that recompute collectives); `run` says
    whether what it saw is otherwise as expected."""
    plain, expected, _ = run("plain", None)
    outcome = {}
    for name, policy in policies.items():
        count, grads, consistent = run(name, policy)
        exact = all(torch.equal(a, e) for a, e in zip(grads, expected, strict=True))
        outcome[name] = consistent and exact and (count > plain if name in RECOMPUTING else count == plain)
    return outcome


def _worker(rank: int, port: int, results: dict[tuple[int, str, str], bool]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        import remat

        from conftest import BUILT_IN_POLICIES

        warnings.simplefilter("ignore", remat.RematFallbackWarning)
        mesh = init_device_mesh("cpu", (WORLD,))
        sequence = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        inputs = {
            "tp": torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
            "sp": sequence.chunk(WORLD, 1)[rank],  # (batch, sequence, hidden): each rank holds its part of the sequence
        }
        for kind, block in KINDS.items():
            for name in POLICY_NAMES:
                torch.manual_seed(0)
                reference = torch.nn.ModuleList([block() for _ in range(2)])
                model = copy.deepcopy(reference)
                for layer in [*reference, *model]:
                    parallelize_module(layer, mesh, _tp_plan(kind))  # type: ignore[arg-type]
                remat.checkpoint_layers(model, BUILT_IN_POLICIES[name])
                expected, actual = _steps(reference, inputs[kind]), _steps(model, inputs[kind])
                replayed = all(layer.forward.cache_info()["replays"] == 1 for layer in model)
                equal = all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
                reported = _reports_what_it_keeps(model, inputs[kind], name)
                results[(rank, kind, name)] = replayed and equal and reported
        results[(rank, "tp", "refused under grad")] = _refused_under_a_transform(mesh, inputs["tp"])
        for name, ok in _backward_communicates_as_without_remat(mesh, inputs["sp"]).items():
            results[(rank, "sp communication", name)] = ok
        for name, ok in _traced_region_communicates_as_without_remat(inputs["tp"]).items():
            results[(rank, "traced communication", name)] = ok
        for name, ok in _process_group_calls_replay_as_without_remat(inputs["tp"]).items():
            results[(rank, "process group calls", name)] = ok
        for name, ok in _compiled_region_communicates_as_without_remat(inputs["tp"]).items():
            results[(rank, "compiled communication", name)] = ok
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_tensor_parallel_layers_equal_no_remat_on_every_rank_under_every_policy() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
        outcome = dict(results)
    expected = {(rank, kind, name): True for rank in range(WORLD) for kind in KINDS for name in POLICY_NAMES}
    expected.update({(rank, "tp", "refused under grad"): True for rank in range(WORLD)})
    for kind in ("sp communication", "traced communication"):
        names = [*POLICY_NAMES, RECOMPUTED, TORCH_RECOMPUTES, TORCH_SAVES]
        expected.update({(rank, kind, name): True for rank in range(WORLD) for name in names})
    compiled = ["nothing", RECOMPUTED, TORCH_RECOMPUTES, TORCH_SAVES]
    expected.update({(rank, "compiled communication", name): True for rank in range(WORLD) for name in compiled})
    calls = [*POLICY_NAMES, "refused under grad"]
    expected.update({(rank, "process group calls", name): True for rank in range(WORLD) for name in calls})
    assert outcome == expected


# FSDP2 x TP: where the FSDP units are. "layers": each layer one unit, its hooks around the
# region; "inside": the layer's Linears units of their own too, whose hooks gather their
# parameters inside the region (again in the recompute, after the forward freed them);
# "inside, kept gathered": those units keep their gathered parameters after forward
# (reshard_after_forward=False), so the recompute gathers nothing and must read them as left.
FSDP_LAYOUTS = {"layers": None, "inside": True, "inside, kept gathered": False}
FSDP_POLICY_NAMES = ["none", "nothing", "dots", "everything"]


def _fsdp_worker(rank: int, port: int, results: dict[tuple[int, str, str], bool]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        import remat

        from conftest import BUILT_IN_POLICIES

        warnings.simplefilter("ignore", remat.RematFallbackWarning)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1 + mesh["dp"].get_local_rank()))

        def build(layout: str, policy_name: str | None) -> torch.nn.Module:
            torch.manual_seed(0)
            model = torch.nn.Sequential(_Block(), _Block())
            for layer in model:
                parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
                if FSDP_LAYOUTS[layout] is not None:
                    for linear in (layer.up, layer.down):
                        fully_shard(linear, mesh=mesh["dp"], reshard_after_forward=FSDP_LAYOUTS[layout])
            if policy_name is not None:
                remat.checkpoint_layers(list(model), BUILT_IN_POLICIES[policy_name])
            for layer in model:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            return model

        def two_steps(model: torch.nn.Module) -> list[torch.Tensor]:
            seen = []
            for step in range(2):
                torch.manual_seed(5 + step)
                loss = model(x).pow(2).sum()
                loss.backward()
                seen += [loss.detach(), *(p.grad.to_local().clone() for p in model.parameters()), torch.rand(2)]  # type: ignore[union-attr]
                model.zero_grad()
            return seen

        def kept(model: torch.nn.Module) -> list[tuple[object, ...]]:
            """What remat.report says the model's layers keep on this rank, in order."""
            found = remat.report(model, x)
            assert len(found.replayed) == 2
            # what FSDP allocates itself (the buffer it gathers parameters into, which a policy
            # that keeps every output keeps) apart, the values tensor parallel's layers keep
            fsdp_buffer = torch.ops.aten.empty.memory_format
            return [(r.op, r.shape, r.dtype) for r in found.residuals if r.kind == "intermediate" and r.op is not fsdp_buffer]

        def tensor_parallel_only(policy_name: str) -> torch.nn.Module:
            torch.manual_seed(0)
            model = torch.nn.Sequential(_Block(), _Block())
            for layer in model:
                parallelize_module(layer, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            remat.checkpoint_layers(list(model), BUILT_IN_POLICIES[policy_name])
            return model

        for layout in FSDP_LAYOUTS:
            expected = two_steps(build(layout, None))
            for name in FSDP_POLICY_NAMES:
                model = build(layout, name)
                actual = two_steps(model)
                equal = all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
                # FSDP shards and gathers parameters: the values a layer keeps are tensor parallel's
                reported = kept(model) == kept(tensor_parallel_only(name))
                results[(rank, layout, name)] = equal and reported
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_fsdp2_by_tensor_parallel_layers_equal_no_remat_on_every_rank() -> None:
    """torch.utils.checkpoint recomputes with what memory holds in backward; a replayed
    region starts its recompute from what the forward saw, except memory a copy filled
    (FSDP's gathered parameters): a gather the recompute repeats fills it again, one it
    does not (kept gathered) left it as the forward read it."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_worker, args=(_free_port(), results), nprocs=4, join=True)
        outcome = dict(results)
    expected = {(rank, layout, name): True for rank in range(4) for layout in FSDP_LAYOUTS for name in FSDP_POLICY_NAMES}
    assert outcome == expected
