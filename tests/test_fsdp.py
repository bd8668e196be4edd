"""train_fsdp.py: FSDP2 trains the model DDP trains, at every world size; its sharded
checkpoints resume exactly, on another world size too, and survive what DDP's survive."""

import shutil

import pytest
import torch

import checkpointing
import generate
from conftest import (BF16, FAST, assert_follows_in_bf16, assert_same_model, assert_same_weights, ddp_two_ranks,
                      load_weights, run_script)
from test_bad_inputs import refused_in_process
from test_failures import exit_codes, fault_env

# Clipping is the one place where FSDP adds up in another order than DDP: it takes each
# gradient's norm from the norms of its shards. Without clipping FSDP(2) and DDP(2) end
# bitwise equal; with it, within the rounding that order makes: a multiple of the rounding
# floor measured in this session (conftest.FLOOR_MULTIPLE), as for another world size.


def fsdp_two_ranks(runs):
    return runs("fsdp2", "train_fsdp.py", nproc=2)


def args(runs, out, *extra):
    return ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), *extra]


def test_fsdp_on_two_ranks_trains_the_same_model_as_ddp(runs, floor):
    assert_same_model(fsdp_two_ranks(runs), ddp_two_ranks(runs), floor)


def test_without_clipping_fsdp_on_two_ranks_equals_ddp_bitwise(runs):
    fsdp = runs("fsdp2_noclip", "train_fsdp.py", ["--grad-clip", "0"], nproc=2)
    ddp = runs("ddp2_noclip", "train_ddp.py", ["--grad-clip", "0"], nproc=2)
    assert_same_model(fsdp, ddp)


def test_fsdp_in_a_world_of_one_equals_one_process(runs):
    assert_same_model(runs("fsdp1", "train_fsdp.py"), runs("dp", "train_dp.py"))


def test_gradient_accumulation_under_fsdp_trains_the_same_model(runs, floor):
    accum = runs("fsdp2_accum2", "train_fsdp.py", ["--grad-accum", "2"], nproc=2)
    assert_same_model(accum, fsdp_two_ranks(runs), floor)


def test_each_rank_writes_its_own_shard_and_model_pt_is_a_plain_state_dict(runs, capsys):
    out = fsdp_two_ranks(runs)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-00000004", "checkpoint-00000008", "config.json",
                                                     "metrics.jsonl", "model.pt", "tokenizer.json"]
    shards = sorted(p.name for p in (out / "checkpoint-00000008").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"]  # one file per rank
    model, _ = checkpointing.load_trained(out)  # strict load into model.py's model
    assert model.state_dict().keys() == load_weights(runs("dp", "train_dp.py")).keys()
    generate.main([str(out), "--prompt", "the", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("the")


def test_a_preempted_run_stops_cleanly_and_resumes_on_two_ranks_bitwise_and_on_one_within_rounding(runs, tmp_path,
                                                                                                  floor):
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "sigterm-launcher", step=3), check=False)
    assert "stopped by a signal after step 3 of 8: " in proc.stdout
    assert exit_codes(tmp_path) == {"exit-rank0": "0", "exit-rank1": "0"}
    assert (out / "checkpoint-00000003" / "__1_0.distcp").is_file() and not (out / "model.pt").exists()
    one_rank = tmp_path / "one-rank"
    shutil.copytree(out, one_rank)
    run_script("train_fsdp.py", args(runs, out, "--resume"), nproc=2)
    assert_same_weights(out, reference)
    proc = run_script("train_fsdp.py", args(runs, one_rank, "--resume"))  # saved by 2 ranks, resharded for 1
    assert f"resumed from {one_rank}/checkpoint-00000003 at step 3" in proc.stdout
    assert_same_weights(one_rank, reference, floor)


def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(runs, tmp_path):
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "kill", step=8, rank=1), torchrun_args=["--max-restarts=1"])
    assert f"resumed from {out}/checkpoint-00000004 at step 4 (restart 1)" in proc.stdout
    assert_same_weights(out, reference)


def test_an_incomplete_newest_checkpoint_falls_back_and_a_half_written_one_is_cleared(runs, tmp_path):
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "checkpoint-00000008" / ".metadata").unlink()  # as if a disk lost it
    (out / "checkpoint-00000009.tmp").mkdir()  # a save that not every rank finished
    (out / "checkpoint-00000009.tmp" / "__0_0.distcp").write_bytes(b"half")
    proc = run_script("train_fsdp.py", args(runs, out, "--resume"), nproc=2)
    assert "checkpoint-00000008 has no .metadata: not a complete checkpoint; falling back to checkpoint-00000004" \
        in proc.stderr
    assert not (out / "checkpoint-00000009.tmp").exists()
    assert_same_weights(out, reference)


@pytest.mark.parametrize("script, run, message", [
    ("train_fsdp.py", "dp", "holds checkpoints of train_dp.py/train_ddp.py, not sharded ones: continue that run "
                            "with train_ddp.py"),
    ("train_ddp.py", "fsdp2", "holds sharded checkpoints of train_fsdp.py: continue that run with train_fsdp.py"),
    ("train_dp.py", "fsdp2", "holds sharded checkpoints of train_fsdp.py"),
])
def test_a_run_of_the_other_kind_is_refused_and_left_untouched(runs, tmp_path, script, run, message, monkeypatch,
                                                               capsys):
    out = tmp_path / "run"
    shutil.copytree(fsdp_two_ranks(runs) if run == "fsdp2" else runs("dp", "train_dp.py"), out)
    refused_in_process(script, ["--dataset", str(runs.corpus), *FAST, "--resume"], out, message, monkeypatch, capsys)


def test_bf16_under_fsdp_learns_trains_the_same_model_on_two_ranks_as_on_one_and_saves_fp32_weights(runs,
                                                                                                   bf16_floor):
    """FSDP's bf16 differs from autocast's by design (conftest.BF16_MULTIPLE), so the
    reference is FSDP's bf16 in a world of one: the same arithmetic, added in another order."""
    out = runs("fsdp2_bf16", "train_fsdp.py", BF16, nproc=2)
    assert_follows_in_bf16(out, runs("fsdp1_bf16", "train_fsdp.py", BF16), bf16_floor)
    assert all(w.dtype == torch.float32 for w in load_weights(out).values())


@pytest.fixture
def world_of_one():
    """A gloo process group of one in this process, torn down after the test."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def test_a_sharded_save_builds_no_cuda_loader_in_dcps_writer_thread(world_of_one, tmp_path, monkeypatch):
    """With CUDA available, DCP's writer by default copies tensors ahead from a GPU on the
    current stream of its own thread, which is GPU 0's whatever the rank's GPU: every rank
    would open a CUDA context on GPU 0. Our shards are staged in CPU memory before the thread
    starts, so no such loader may be built. CUDA's presence is faked: the spy sees the choice."""
    import threading

    from torch.distributed.checkpoint import filesystem
    from torch.distributed.device_mesh import init_device_mesh

    import sharded_checkpointing
    import train_fsdp
    from model import LlamaConfig, LlamaForPretraining
    built_in = []
    real_init = filesystem._OverlappingCpuLoader.__init__

    def spy(self, *args, **kwargs):
        built_in.append(threading.current_thread().name)
        return real_init(self, *args, **kwargs)

    config = LlamaConfig(vocab_size=97, max_position_embeddings=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = train_fsdp.shard(LlamaForPretraining(config), init_device_mesh("cpu", (1,)), torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    writer = sharded_checkpointing.ShardedCheckpointWriter(str(tmp_path), keep=2, group=world_of_one)
    monkeypatch.setattr(filesystem._OverlappingCpuLoader, "__init__", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    writer.save(model, optimizer, {"step": 1})
    writer.wait()  # re-raises what failed in the background
    monkeypatch.undo()
    assert built_in == []
    assert sorted(p.name for p in (tmp_path / "checkpoint-00000001").iterdir()) == [
        ".metadata", "__0_0.distcp", "train_state.pt"]


def test_a_usage_error_while_a_sharded_save_is_in_flight_ends_that_save_then_exits_with_one_line(runs, tmp_path):
    """The loss turns NaN at step 5 while the checkpoint of step 4 (finite, checked before it
    was saved) is still being written by every rank over the gloo group. Both ranks print one
    line and exit 2 once that save is complete: no traceback from the writer, no .tmp/ left,
    no rank left waiting for a peer that tore the process group down under it."""
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out, "--log-every", "1"), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "diverge-mid-save", step=5), check=False, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: training diverged: the loss is nan at step 5. Start again with a lower --lr (was "
                      "0.001) or a longer --warmup-steps (was 2)"], proc.stderr
    assert "Exception in thread" not in proc.stderr, proc.stderr
    assert exit_codes(tmp_path) == {"exit-rank0": "2", "exit-rank1": "2"}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-00000004"]
    assert sorted(p.name for p in (out / "checkpoint-00000004").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"]
