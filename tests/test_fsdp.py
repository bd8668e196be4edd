"""train_fsdp.py: FSDP2 trains the model DDP trains, at every world size; its sharded
checkpoints resume exactly, on another world size too, and survive what DDP's survive."""

import shutil

import pytest
import torch

import checkpointing
import generate
from conftest import FAST, ddp_two_ranks, load_weights, max_weight_diff, metrics, run_script, without_speed
from test_bad_inputs import refused_in_process
from test_failures import exit_codes, fault_env

# Clipping is the one place where FSDP sums in another order than DDP: it takes each
# gradient's norm from the norms of its shards. Without clipping FSDP(2) and DDP(2) end
# bitwise equal; with it, within the rounding that order makes (3.0e-7 here).
CLIP_TOLERANCE = 1e-6
DDP_TOLERANCE = 1e-5  # as in test_training.py: another world size sums in another order


def fsdp_two_ranks(runs):
    return runs("fsdp2", "train_fsdp.py", nproc=2)


def args(runs, out, *extra):
    return ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), *extra]


def test_fsdp_on_two_ranks_trains_the_same_model_as_ddp(runs):
    fsdp, ddp = fsdp_two_ranks(runs), ddp_two_ranks(runs)
    assert max_weight_diff(load_weights(fsdp), load_weights(ddp)) < CLIP_TOLERANCE
    for ours, theirs in zip(without_speed(metrics(fsdp)), without_speed(metrics(ddp)), strict=True):
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[k] - theirs[k]) < 1e-5 for k in ours)


def test_without_clipping_fsdp_on_two_ranks_equals_ddp_bitwise(runs):
    fsdp = runs("fsdp2_noclip", "train_fsdp.py", ["--grad-clip", "0"], nproc=2)
    ddp = runs("ddp2_noclip", "train_ddp.py", ["--grad-clip", "0"], nproc=2)
    assert max_weight_diff(load_weights(fsdp), load_weights(ddp)) == 0.0
    assert without_speed(metrics(fsdp)) == without_speed(metrics(ddp))


def test_fsdp_in_a_world_of_one_equals_one_process(runs):
    fsdp, dp = runs("fsdp1", "train_fsdp.py"), runs("dp", "train_dp.py")
    assert max_weight_diff(load_weights(fsdp), load_weights(dp)) == 0.0
    assert without_speed(metrics(fsdp)) == without_speed(metrics(dp))


def test_gradient_accumulation_under_fsdp_trains_the_same_model(runs):
    accum = runs("fsdp2_accum2", "train_fsdp.py", ["--grad-accum", "2"], nproc=2)
    assert max_weight_diff(load_weights(accum), load_weights(fsdp_two_ranks(runs))) < DDP_TOLERANCE


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


def test_a_preempted_run_stops_cleanly_and_resumes_on_two_ranks_bitwise_and_on_one_within_rounding(runs, tmp_path):
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
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0
    proc = run_script("train_fsdp.py", args(runs, one_rank, "--resume"))  # saved by 2 ranks, resharded for 1
    assert f"resumed from {one_rank}/checkpoint-00000003 at step 3" in proc.stdout
    assert max_weight_diff(load_weights(reference), load_weights(one_rank)) < DDP_TOLERANCE


def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(runs, tmp_path):
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "kill", step=8, rank=1), torchrun_args=["--max-restarts=1"])
    assert f"resumed from {out}/checkpoint-00000004 at step 4 (restart 1)" in proc.stdout
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0


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
    assert max_weight_diff(load_weights(reference), load_weights(out)) == 0.0


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


def test_bf16_under_fsdp_learns_and_saves_fp32_weights(runs):
    out = runs("fsdp2_bf16", "train_fsdp.py", ["--dtype", "bf16"], nproc=2)
    rows = [row for row in metrics(out) if "loss" in row]
    assert rows[-1]["loss"] < rows[0]["loss"]
    reference = [row for row in metrics(fsdp_two_ranks(runs)) if "loss" in row]
    assert abs(rows[-1]["loss"] - reference[-1]["loss"]) < 0.05  # bf16 rounding, not another model
    assert all(w.dtype == torch.float32 for w in load_weights(out).values())
