"""Tensor parallelism (DTensor) against no remat: two gloo processes on CPU, a stack of
transformer MLP blocks parallelized colwise / rowwise with dropout on. remat traces plain
tensors only, so each layer runs replayed (as torch.utils.checkpoint runs it, the policy
asked op by op); loss, every local gradient shard and the random stream after equal no
remat bitwise on every rank, under every built-in policy. The processes are spawned and
joined by the test."""

from __future__ import annotations

import copy
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _steps(layers: torch.nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(5)  # the same seed on every rank, as tensor parallel code keeps it
    h = x
    for layer in layers:
        h = layer(h)
    loss = h.pow(2).sum()
    loss.backward()
    return [loss.detach(), *(p.grad.to_local().clone() for p in layers.parameters()), torch.rand(2)]  # type: ignore[union-attr]


def _worker(rank: int, port: int, results: dict[tuple[int, str], bool]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        import remat
        from conftest import BUILT_IN_POLICIES

        warnings.simplefilter("ignore", remat.RematFallbackWarning)
        mesh = init_device_mesh("cpu", (WORLD,))
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        for name in POLICY_NAMES:
            torch.manual_seed(0)
            reference = torch.nn.ModuleList([_Block() for _ in range(2)])
            model = copy.deepcopy(reference)
            for layer in [*reference, *model]:
                parallelize_module(layer, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            remat.checkpoint_layers(model, BUILT_IN_POLICIES[name])
            expected, actual = _steps(reference, x), _steps(model, x)
            replayed = all(layer.forward.cache_info()["replays"] == 1 for layer in model)
            results[(rank, name)] = replayed and all(torch.equal(a, e) for a, e in zip(actual, expected))
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
    expected = {(rank, name): True for rank in range(WORLD) for name in POLICY_NAMES}
    assert outcome == expected
