"""train_fsdp.py --replicas R: hybrid sharding (HSDP), a 2-D mesh of R replicas by
world_size / R shards. At every shape of 4 ranks it trains the model DDP trains, with
gradient accumulation and clipping; it all-reduces across replicas once a step, however many
micro-steps the step accumulates; and its checkpoints resume on any other shape."""

import shutil

import pytest
import torch

from benchmarks import bench_network
from conftest import FAST, MODEL, assert_same_model, assert_same_weights, metrics, run_script, spied, train
from model import PRESETS, LlamaForPretraining
from test_bad_inputs import refused_in_process
from training import run_folder
from training.config import mesh_shape

ACCUM = ["--grad-accum", "2"]  # 8 sequences a step: 1 a rank and micro-step on 4 ranks


def hsdp(runs, replicas: int):
    """A 4-rank run as replicas x (4 / replicas), accumulating 2 micro-steps, its collectives counted."""
    return spied(runs, f"hsdp{replicas}x{4 // replicas}", "train_fsdp.py", [*ACCUM, "--replicas", str(replicas)],
                 nproc=4)


def args(runs, out, *extra):
    return ["--dataset", str(runs.corpus), *FAST, *ACCUM, "--out-dir", str(out), *extra]


@pytest.mark.parametrize("replicas", [2, 4, 1], ids=["2x2", "4x1", "1x4"])
def test_hsdp_at_every_shape_of_4_ranks_trains_the_same_model_as_ddp(runs, floor, replicas):
    """4x1 is pure replication (each rank holds the whole model, as DDP), 1x4 plain FSDP."""
    out, _ = hsdp(runs, replicas)
    ddp = runs("ddp2_accum2", "train_ddp.py", ACCUM, nproc=2)  # test_training's: the model DDP trains
    norms = [row["grad_norm"] for row in metrics(ddp) if "grad_norm" in row]
    assert max(norms) > 1.0  # --grad-clip 1 scaled these steps: the norm over both mesh dimensions counts
    assert_same_model(out, ddp, floor)


def test_the_replicas_all_reduce_once_a_step_however_many_micro_steps_it_accumulates(runs):
    """Each FSDP group with weights (a decoder layer, the embedding, the final norm with the LM
    head) all-reduces its gradient shard over its replicas (a group of 2) once a step: 8 steps
    of 2 micro-steps, not 16. Those are the bytes benchmarks/bench_network.py counts as HSDP's
    on the network: the fp32 shard of every weight, once a step. Without --replicas there is
    no such group at all."""
    groups = PRESETS[MODEL]["num_hidden_layers"] + 2
    out, spies = hsdp(runs, 2)
    assert [spy["all_reduces"].get("2", 0) for spy in spies] == [8 * groups] * 4
    config, _ = run_folder.read_config(out)
    with torch.device("meta"):
        shapes = [p.shape for p in LlamaForPretraining(config).parameters()]
    assert [spy["all_reduce_bytes"]["2"] for spy in spies] == [8 * 4 * bench_network.shard_elements(shapes, 2)] * 4
    _, plain = hsdp(runs, 1)
    assert [spy["all_reduces"].get("2", 0) for spy in plain] == [0] * 4


def test_replicas_make_the_first_mesh_dimension_and_each_replicas_ranks_the_second():
    """--replicas R gives the mesh (R, world_size / R), named ("replicate", "shard"): fully_shard
    replicates over the first dimension of a 2-D mesh and shards over the second, whatever the
    names say, and a row of the mesh is world_size / R consecutive ranks, which torchrun puts on
    one node. Swapped, 2 nodes of 8 GPUs would shard over the network and replicate within each
    node; on 4 ranks as 4x1 or 1x4 (below) both train DDP's model, so no loss would tell."""
    assert mesh_shape(1, 4) == ((4,), ("shard",))
    assert mesh_shape(2, 16) == ((2, 8), ("replicate", "shard"))
    assert mesh_shape(4, 4) == ((4, 1), ("replicate", "shard"))


@pytest.mark.parametrize("replicas", [2, 4], ids=["2x2", "4x1"])
def test_each_rank_holds_its_replicas_share_and_the_memory_check_counts_that_share(runs, replicas):
    """Where the weights are, read from each rank of the runs (tests/spy.py): in 2x2 ranks 0
    and 1 (one node's) split every weight between them, as do ranks 2 and 3 with the same
    halves, and each rank all-reduces its shards with its peer in the other replica (r and
    r + 2); in 4x1 every rank holds the whole model. The memory check, made before anything is
    written, counted the same share. A mesh of another shape (1x4 for 4x1) or a check that
    divided by the world size trains the same model: only this sees it."""
    shards = 4 // replicas
    out, spies = hsdp(runs, replicas)
    model_config, _ = run_folder.read_config(out)
    with torch.device("meta"):
        total = sum(p.numel() for p in LlamaForPretraining(model_config).parameters())
    held = [spy["weights_held"] for spy in spies]
    assert held == held[:shards] * replicas  # the replicas hold the same shards
    assert sum(held[:shards]) == total  # a replica's ranks hold every element once
    assert [spy["memory_shards"] for spy in spies] == [shards] * 4
    if replicas == 2:  # the all-reduce of a rank's shards goes to its peer in the other replica, over the network
        pairs = [[group for group in spy["all_reduce_groups"] if len(group) == 2] for spy in spies]
        assert pairs == [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]


def test_a_stopped_hsdp_run_resumes_on_its_own_shape_bitwise(runs, tmp_path):
    full, _ = hsdp(runs, 2)
    half = runs.copy(full, tmp_path / "run")
    shutil.rmtree(half / "checkpoint-00000008")
    (half / "model.pt").unlink()
    proc = run_script("train_fsdp.py", args(runs, half, "--replicas", "2", "--resume"), nproc=4)
    assert f"resumed from {half}/checkpoint-00000004 at step 4" in proc.stdout
    assert_same_weights(half, full)


def test_hsdp_checkpoints_resume_on_every_other_shape_down_to_one_process(runs, tmp_path, floor):
    """2x2's step-4 checkpoint resumed as 4x1 for a step, then as 1x4 (plain FSDP on 4 ranks)
    for one more, then in one process: each resharding what the last saved. The same model as
    2x2 all the way, to rounding."""
    full, _ = hsdp(runs, 2)
    out = runs.copy(full, tmp_path / "run")
    shutil.rmtree(out / "checkpoint-00000008")
    (out / "model.pt").unlink()
    for replicas, stop in [(4, 5), (1, 6)]:
        run_script("train_fsdp.py", args(runs, out, "--replicas", str(replicas), "--stop-at-step", str(stop),
                                         "--resume"), nproc=4)
    printed = train("train_fsdp.py", args(runs, out, "--resume"))
    assert f"resumed from {out}/checkpoint-00000006 at step 6" in printed
    assert_same_weights(out, full, floor)
    assert (out / "model.pt").exists()


def test_replicas_that_do_not_divide_the_world_are_one_line_and_ddp_has_no_such_flag(tmp_path, capsys):
    refused_in_process("train_fsdp.py", ["--replicas", "2"], tmp_path / "run",
                       "--replicas 2 does not divide the world size 1", capsys)
    refused_in_process("train_ddp.py", ["--replicas", "2"], tmp_path / "run", "unrecognized arguments: --replicas 2",
                       capsys)
