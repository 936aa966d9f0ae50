"""amesh.torch: process groups on ProcMeshes, tensors in messages, the torch examples."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import anyio
import pytest
import torch

import amesh.torch
from amesh import ActorError, ProcMesh
from amesh.torch import init_process_group

from .test_examples import run_example
from .torch_actors import DistWorker

pytestmark = pytest.mark.anyio


def number_after(label: str, text: str) -> float:
    match = re.search(rf"^{label}: ([0-9.]+)", text, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{text}"
    return float(match.group(1))


# -- process groups ---------------------------------------------------------------------


async def test_four_ranks_get_env_and_all_reduce() -> None:
    with anyio.fail_after(110):
        # "hosts" x "gpus" on one machine: local ranks count over the machine, and
        # CUDA_VISIBLE_DEVICES indexes the devices the workers inherited.
        env = {"CUDA_VISIBLE_DEVICES": "5,7"}
        async with ProcMesh(per_host={"hosts": 2, "gpus": 2}, env=env) as procs:
            group = await init_process_group(procs, timeout=60)
            assert (group.backend, group.world_size, group.master_addr) == ("gloo", 4, "127.0.0.1")
            workers = await procs.spawn("workers", DistWorker)  # spawned after the group

            envs = await workers.env.call()
            for point, got in envs.items():
                assert got == {
                    "RANK": str(point.rank),
                    "WORLD_SIZE": "4",
                    "LOCAL_RANK": str(point.rank),
                    "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(group.master_port),
                    "CUDA_VISIBLE_DEVICES": "57"[point["gpus"]],
                }
            ranks = await workers.group.call()
            assert [r[:3] for r in ranks.values()] == [(r, 4, "gloo") for r in range(4)]
            # rank r of the group is the process at flat rank r of the mesh
            assert (await workers.all_gather_pids.call()).values() == [procs.pids] * 4
            sums = await workers.all_reduce.call(1.5)
            assert sums.values() == [6.0] * 4

            await group.destroy()
            await group.destroy()  # idempotent
            assert (await workers.initialized.call()).values() == [False] * 4
            again = await init_process_group(procs, timeout=60)
            assert (await workers.all_reduce.call(2.0)).values() == [8.0] * 4
            assert "live" in repr(again)


async def test_two_proc_meshes_have_separate_groups(tmp_path: Path) -> None:
    with anyio.fail_after(110):
        env = {"AMESH_TEST_TORCH_CLEANUP_DIR": str(tmp_path)}
        async with (
            ProcMesh(per_host={"gpus": 2}, env=env) as a,
            ProcMesh(per_host={"gpus": 2}) as b,
        ):
            groups: dict[str, amesh.torch.DistGroup] = {}

            async def init(name: str, procs: ProcMesh) -> None:
                groups[name] = await init_process_group(procs, timeout=60)

            async with anyio.create_task_group() as tg:
                tg.start_soon(init, "a", a)
                tg.start_soon(init, "b", b)
            assert groups["a"].master_port != groups["b"].master_port
            wa = await a.spawn("wa", DistWorker)
            wb = await b.spawn("wb", DistWorker)
            results: dict[str, list[float]] = {}

            async def reduce(name: str, mesh: amesh.ActorMesh[DistWorker], x: float) -> None:
                results[name] = (await mesh.all_reduce.call(x)).values()

            async with anyio.create_task_group() as tg:
                tg.start_soon(reduce, "a", wa, 1.0)
                tg.start_soon(reduce, "b", wb, 10.0)
            assert results == {"a": [2.0, 2.0], "b": [20.0, 20.0]}
            assert (await wa.all_gather_pids.call()).values() == [a.pids] * 2
            assert (await wb.all_gather_pids.call()).values() == [b.pids] * 2

            with pytest.raises(RuntimeError, match="already belong to a default process group"):
                await init_process_group(a)
            assert (await wa.all_reduce.call(1.0)).values() == [2.0, 2.0]  # still intact
        # the group outlived the actors spawned after it: their __cleanup__ could use it
        assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
            "rank0": "2.0",
            "rank1": "2.0",
        }


async def test_bad_gpus_coordinate_fails_cleanly() -> None:
    with anyio.fail_after(90):
        async with ProcMesh(per_host={"gpus": 1}, env={"CUDA_VISIBLE_DEVICES": ""}) as procs:
            with pytest.raises(ActorError, match="gpus coordinate 0 is out of range") as info:
                await init_process_group(procs, timeout=30)
            assert info.value.type_name == "ValueError"
            # nothing was left half made: opting out of CUDA_VISIBLE_DEVICES works
            group = await init_process_group(procs, cuda_visible_devices=False, timeout=30)
            workers = await procs.spawn("workers", DistWorker)
            assert (await workers.env.call()).values()[0]["CUDA_VISIBLE_DEVICES"] == ""
            assert (await workers.all_reduce.call(3.0)).values() == [3.0]
            assert group.world_size == 1


async def test_init_needs_a_proc_mesh() -> None:
    with anyio.fail_after(5), pytest.raises(TypeError, match="needs a ProcMesh"):
        await init_process_group("procs")


def test_local_ranks_count_per_host() -> None:
    from amesh.torch import _rank_envs

    envs = _rank_envs(["a", "a", "b", "b", "b"], "a", 1234)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "3", "3", "3"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {
        ("a", "1234", "5")
    }
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4"]


# -- tensors in messages ----------------------------------------------------------------


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    grad = torch.randn(3, generator=g).requires_grad_()
    return {
        "float32": torch.randn(3, 4, generator=g),
        "float64": torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
        "int64": torch.arange(-5, 5),
        "bool": torch.rand(7, generator=g) > 0.5,
        "bfloat16": torch.randn(5, 2, generator=g).to(torch.bfloat16),
        "float16": torch.randn(4, generator=g).to(torch.float16),
        "uint8": torch.arange(0, 256, 17, dtype=torch.uint8),
        "complex64": torch.randn(3, generator=g, dtype=torch.complex64),
        "view": base[1:5, ::3].t(),
        "expanded": torch.tensor([1, 2, 3]).expand(4, 3),
        "zero_d": torch.tensor(3.25),
        "empty": torch.zeros(0, 3),
        "requires_grad": grad,
        "parameter": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "big": torch.randn(1 << 20, generator=g),  # 4 MiB
    }


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is type(want)
    assert got.device.type == "cpu"
    assert (got.dtype, got.shape, got.requires_grad) == (want.dtype, want.shape, want.requires_grad)
    assert torch.equal(got.detach(), want.detach())


async def test_tensors_round_trip_exactly() -> None:
    with anyio.fail_after(90):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            worker = await procs.spawn("worker", DistWorker)
            tensors = sample_tensors()
            back = await worker.echo.call_one(tensors)
            assert back.keys() == tensors.keys()
            for name, want in tensors.items():
                assert_same(back[name], want)
            # alone (not nested), and computed on in the worker
            assert_same(await worker.echo.call_one(tensors["zero_d"]), tensors["zero_d"])
            view = tensors["view"]
            assert_same(await worker.double.call_one(view), view * 2)
            assert_same(back["view"] * 2, view * 2)  # what arrived is an ordinary tensor


# -- the examples ---------------------------------------------------------------------


def test_train_ddp(tmp_path: Path) -> None:
    out = run_example(
        "train_ddp.py",
        "--procs=2",
        "--steps=60",
        "--eval-size=1024",
        f"--ckpt-dir={tmp_path}",
        "--ckpt-every=30",
    )
    assert "2 ranks, backend gloo" in out
    first, last = number_after("first loss", out), number_after("last loss", out)
    assert last < first / 2, out
    assert number_after("eval accuracy", out) >= 0.85, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00030.pt", "step00060.pt"]
    ckpt = torch.load(tmp_path / "step00060.pt")
    assert ckpt["step"] == 60
    assert {"0.weight", "4.bias"} <= set(ckpt["model"])


def test_titan_mini_changes_lr_between_phases() -> None:
    out = run_example("titan_mini.py", "--procs=2", "--steps=30", "--phases=3", "--lr=0.01")
    assert "FSDP2 over 2 ranks (gloo)" in out
    for phase, lr in [(1, "1.0e-02"), (2, "3.0e-03"), (3, "9.0e-04")]:
        assert f"phase {phase}: lr {lr} (ranks use ['{lr}', '{lr}'])" in out, out
    first, last = number_after("first loss", out), number_after("last loss", out)
    assert last < first - 1.0, out


def test_rl_loop_reward_rises() -> None:
    out = run_example("rl_loop.py", "--rounds=6")
    first, last = number_after("first reward", out), number_after("last reward", out)
    assert first < 0.3 and last > first + 0.3, out
    assert "generators report weight version 6" in out, out
    assert "round  6: reward" in out


def test_one_backend_for_the_whole_group() -> None:
    from amesh.torch import _choose_backend

    assert _choose_backend("<mesh>", [1, 1], None) == "nccl"
    # a rank without a device would pick gloo alone and the group would hang
    assert _choose_backend("<mesh>", [1, 0], None) == "gloo"
    assert _choose_backend("<mesh>", [0, 0], None) == "gloo"
    # a gpus dimension of 2 on a host with 1 GPU: not one GPU per rank, so gloo for all
    assert _choose_backend("<mesh>", [1, 1], [0, 1]) == "gloo"
    assert _choose_backend("<mesh>", [2, 2], [0, 1]) == "nccl"


def test_a_gpu_host_that_gets_gloo_says_why(caplog: pytest.LogCaptureFixture) -> None:
    from amesh.torch import _choose_backend
    from amesh.torch._setup import why_not_nccl

    assert why_not_nccl([1, 1]) is None
    assert why_not_nccl([2, 0, 0]) == "no CUDA device at ranks 1, 2"
    assert why_not_nccl([1, 1], [0, 1]) == (
        "more ranks per host than GPUs: the gpus coordinate of rank 1 is past its "
        "host's CUDA devices"
    )
    with caplog.at_level(logging.WARNING, logger="amesh.torch"):
        assert _choose_backend("<mesh>", [1, 1], [0, 1]) == "gloo"
        assert _choose_backend("<mesh>", [0, 0], None) == "gloo"  # no GPU anywhere: quiet
        assert _choose_backend("<mesh>", [2, 2], [0, 1]) == "nccl"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "uses gloo on the CPU, not nccl: more ranks per host than GPUs" in warnings[0]


def test_gpus_coordinate_past_the_hosts_devices_is_refused_under_cuda() -> None:
    from amesh.torch._setup import device_for

    assert device_for(1, None, 2) == "1"
    with pytest.raises(ValueError, match="coordinate 1 is out of range: this host has 1 CUDA"):
        device_for(1, None, 1)
    assert device_for(3, None, 0) == "3"  # not on CUDA: the coordinate only names the rank
    assert device_for(1, "4,6", 8) == "6"
    with pytest.raises(ValueError, match="inherited CUDA_VISIBLE_DEVICES='4'"):
        device_for(1, "4", 8)
