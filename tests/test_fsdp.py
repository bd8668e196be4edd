"""train_fsdp.py: FSDP2 trains the model DDP trains, at every world size; its sharded
checkpoints resume exactly, on another world size too, and survive what DDP's survive."""

import datetime
import json
import pickle
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from conftest import (BF16, FAST, FLOOR_MULTIPLE, MODEL, assert_follows_in_bf16, assert_same_model, assert_same_weights,
                      assert_within, ddp_two_ranks, load_weights, max_weight_diff, metrics, run_script, spied,
                      stopped_at_step_4, train, without_speed)
import data
from model import PRESETS
from test_bad_inputs import refused_in_process
from test_failures import RunsCode, exit_codes, fault_env
from test_using_the_model import config_asking_for, expected_text
from tools import export_hf, generate
from training import config, run_data, tokenized, weights
from training.errors import UsageError

# Clipping is the one place where FSDP adds up in another order than DDP: it takes each
# gradient's norm from the norms of its shards. Without clipping FSDP(2) and DDP(2) end
# bitwise equal; with it, within the rounding that order makes: a multiple of the rounding
# floor measured in this session (conftest.FLOOR_MULTIPLE), as for another world size.


def val_loss_distance(a, b) -> float:
    """The largest relative difference between the val losses two runs logged at the same steps.
    (Only these: a run resumed from a step between two logged ones logs a train loss over
    fewer steps at the next one.)"""
    val = [{row["step"]: row["val_loss"] for row in metrics(run) if "val_loss" in row} for run in (a, b)]
    assert val[0].keys() == val[1].keys()
    return max(abs(val[0][step] - val[1][step]) / val[1][step] for step in val[0])


def fsdp_two_ranks(runs):
    """The reference FSDP run, every file write of each rank recorded (as conftest.ddp_two_ranks)."""
    logs = runs.root / "fsdp2-writes"
    logs.mkdir(exist_ok=True)
    return runs("fsdp2", "train_fsdp.py", nproc=2, wrapper="tests/record_writes.py",
                env={"WATCH_DIR": str(runs.root / "fsdp2"), "WRITE_LOG_DIR": str(logs)})


def args(runs, out, *extra):
    return ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), *extra]


def test_fsdp_on_two_ranks_trains_the_same_model_as_ddp(runs, floor):
    assert_same_model(fsdp_two_ranks(runs), ddp_two_ranks(runs), floor)


def test_without_clipping_fsdp_on_two_ranks_equals_ddp_bitwise(runs):
    """The same weights and logged losses, bitwise. Only the logged grad_norm may round apart:
    FSDP adds each gradient's squares up from its shards' (test_metrics.py compares it)."""
    fsdp = runs("fsdp2_noclip", "train_fsdp.py", ["--grad-clip", "0", "--max-steps", "4"], nproc=2)
    ddp = runs("ddp2_noclip", "train_ddp.py", ["--grad-clip", "0", "--max-steps", "4"], nproc=2)
    assert_same_weights(fsdp, ddp)
    assert without_speed(metrics(fsdp), leave_out=["grad_norm"]) == without_speed(metrics(ddp), leave_out=["grad_norm"])


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
    model, tokenizer = weights.load_trained(out)  # strict load into model.py's model
    assert model.state_dict().keys() == load_weights(runs("dp", "train_dp.py")).keys()
    generate.main([str(out), "--prompt", "the", "--max-new-tokens", "5", "--temperature", "0"])
    assert capsys.readouterr().out == expected_text(model, tokenizer, "the", 5)  # greedy: an argmax loop


def test_an_unfinished_run_is_sampled_from_its_newest_sharded_checkpoint_gathered_in_one_process(runs, tmp_path,
                                                                                                  capsys, floor):
    """generate.py and export_hf.py read model.pt or, while a run is unfinished, its newest
    checkpoint: here 2 ranks' shards of step 4, gathered in one process without a process
    group. They hold the weights of step 4: a one-process run's at step 4, to rounding."""
    out = runs.copy(fsdp_two_ranks(runs), tmp_path / "run")
    (out / "model.pt").unlink()
    shutil.rmtree(out / "checkpoint-00000008")
    capsys.readouterr()
    generate.main([str(out), "--prompt", "the", "--max-new-tokens", "5", "--temperature", "0"])
    printed = capsys.readouterr()
    assert printed.err == (f"warning: no model.pt in {out} (the run has not finished): using checkpoint-00000004, "
                           "step 4, gathered from its shards\n")
    model, tokenizer = weights.load_trained(out)
    assert printed.out == expected_text(model, tokenizer, "the", 5)
    one_process = torch.load(stopped_at_step_4(runs, tmp_path) / "checkpoint.pt", map_location="cpu",
                             weights_only=True)["model"]
    assert_within("weights", max_weight_diff(model.state_dict(), one_process), floor.weights, FLOOR_MULTIPLE)


def test_a_config_that_does_not_fit_the_sharded_weights_is_refused_before_the_model_is_allocated(runs, tmp_path):
    """The same check for an unfinished FSDP run: the shapes come from the .metadata."""
    out = runs.copy(fsdp_two_ranks(runs), tmp_path / "run")
    (out / "model.pt").unlink()
    config_asking_for(out, intermediate_size=2**30)
    with pytest.raises(UsageError, match=re.escape(
            f"the weights in {out} do not fit its config.json: base_model.layers.0.mlp.gate_proj.weight is "
            "(256, 64) in the weights, (1,073,741,824, 64) by config.json")):
        export_hf.main([str(out), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


def test_only_rank_0_writes_the_run_files_and_each_rank_only_its_own_shards(runs):
    out = fsdp_two_ranks(runs)
    logs = runs.root / "fsdp2-writes"
    rank0 = (logs / "rank0.txt").read_text().splitlines()
    rank1 = (logs / "rank1.txt").read_text().splitlines()
    for name in ("model.pt", "metrics.jsonl", "tokenizer.json", "config.json"):
        assert any(line.endswith(f"{out}/{name}") for line in rank0), name
    # rank 1 writes its shard file into each checkpoint's folder (DCP's writer makes sure the
    # folder exists on every rank), and nothing else
    assert rank1 == [event for step in (4, 8) for event in (f"os.mkdir {out}/checkpoint-{step:08d}.tmp",
                                                             f"open {out}/checkpoint-{step:08d}.tmp/__1_0.distcp")]
    assert not [line for line in rank0 if "__1_0" in line]


def test_a_preempted_run_stops_cleanly_and_resumes_on_1_and_4_ranks_within_rounding(runs, tmp_path, floor):
    """SIGTERM to torchrun at step 3: every rank stops after step 3, a sharded checkpoint is
    saved, and the summary names it. Resharded for 1 and for 4 ranks, it resumes the same
    model to rounding (by 2 ranks, bitwise: the test below); --keep-checkpoints 2 then prunes
    checkpoint-00000003 once 4 and 8 are saved."""
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "sigterm-launcher", step=3), check=False)
    row = [row for row in metrics(out) if "loss" in row][-1]  # step 2's: logged every 2 steps
    summary = proc.stdout[proc.stdout.index("stopped by a signal"):].splitlines()
    tokens = re.fullmatch(rf"stopped by a signal after step 3 of 8: ([\d,]+) tokens \(768 positions with padding\) "
                          rf"in \d+:\d\d:\d\d \| train loss {row['loss']:.4f} at step 2", summary[0])
    assert tokens, summary
    logged = 512 * row["tokens_per_s_nonpad"] / row["tokens_per_s"]  # the real tokens of steps 1 and 2
    assert logged + 1 < int(tokens.group(1).replace(",", "")) <= 768  # and step 3's, trained but never logged
    assert summary[1:] == [f"checkpoint saved in {out}/checkpoint-00000003; continue with --resume"]
    assert exit_codes(tmp_path) == {"exit-rank0": "0", "exit-rank1": "0"}
    assert sorted(p.name for p in (out / "checkpoint-00000003").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"]
    assert not (out / "model.pt").exists()
    one_rank, four_ranks = runs.copy(out, tmp_path / "one-rank"), runs.copy(out, tmp_path / "four-ranks")
    printed = train("train_fsdp.py", args(runs, one_rank, "--resume"))  # saved by 2 ranks, resharded for 1
    assert f"resumed from {one_rank}/checkpoint-00000003 at step 3" in printed
    assert_same_weights(one_rank, reference, floor)
    run_script("train_fsdp.py", args(runs, four_ranks, "--resume"), nproc=4)  # ...and for 4
    assert_same_weights(four_ranks, reference, floor)
    assert sorted(p.name for p in four_ranks.glob("checkpoint-*")) == ["checkpoint-00000004", "checkpoint-00000008"]
    # 9 held-out documents, 23 windows, over 4 ranks: the last evaluates a padding sequence besides its 5
    assert_within("val losses", val_loss_distance(four_ranks, reference), floor.loss, FLOOR_MULTIPLE)


def test_a_checkpoint_of_one_rank_resumes_on_two(runs, tmp_path, floor):
    """FSDP in a world of one stopped at step 4 (its checkpoint-00000008 and model.pt taken
    away), resumed by 2 ranks: each now reads half of every tensor."""
    half = runs.copy(runs("fsdp1", "train_fsdp.py"), tmp_path / "run")
    shutil.rmtree(half / "checkpoint-00000008")
    (half / "model.pt").unlink()
    proc = run_script("train_fsdp.py", args(runs, half, "--resume"), nproc=2)
    assert f"resumed from {half}/checkpoint-00000004 at step 4" in proc.stdout
    assert_same_model(half, fsdp_two_ranks(runs), floor)


def test_sigusr1_and_ctrl_c_on_one_rank_stop_every_rank_even_with_a_save_hanging_on_a_slow_disk(runs, tmp_path):
    """SIGUSR1 (Slurm's warning) and Ctrl-C reach rank 0 in step 6 (either alone would stop the
    run; unhandled, either would kill it); rank 1 learns of them through the per-step flag.
    Rank 0's write of the step-4 checkpoint hangs on a slow disk until step 6: training went
    on meanwhile, and the stop's own save waits for it. Both ranks exit 0; the resumed run is
    the uninterrupted one, bitwise."""
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "slow-disk,sigusr1,sigint", step=6))
    assert "stopped by a signal after step 6 of 8" in proc.stdout
    assert "Ctrl-C: saving after this step" in proc.stderr
    assert exit_codes(tmp_path) == {"exit-rank0": "0", "exit-rank1": "0"}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-00000004", "checkpoint-00000006"]
    run_script("train_fsdp.py", args(runs, out, "--resume"), nproc=2)
    assert_same_weights(out, reference)


def test_a_worker_killed_before_the_first_checkpoint_restarts_from_step_0(runs, tmp_path):
    """kill -9 of rank 1 in step 3, before the first checkpoint (step 4): the restarted workers
    have nothing to resume. They start again over the files of their own first attempt (no
    refusal of a folder holding another run's files), and the step-2 row it logged is not
    left twice in metrics.jsonl."""
    reference = fsdp_two_ranks(runs)
    out = tmp_path / "run"
    proc = run_script("train_fsdp.py", args(runs, out), nproc=2, wrapper="tests/inject_fault.py",
                      env=fault_env(tmp_path, "kill", step=3, rank=1), torchrun_args=["--max-restarts=1"])
    assert "resumed" not in proc.stdout and re.search(r"done after step 8 of 8: [\d,]+ tokens \(2,048 positions",
                                                      proc.stdout)
    assert_same_model(out, reference)


def test_an_incomplete_newest_checkpoint_falls_back_and_a_half_written_one_is_cleared(runs, tmp_path, capsys, floor):
    """Resumed in a world of one (in this process): the 2-rank shards of step 4 are resharded."""
    reference = fsdp_two_ranks(runs)
    out = runs.copy(reference, tmp_path / "run")
    (out / "checkpoint-00000008" / ".metadata").unlink()  # as if a disk lost it
    (out / "checkpoint-00000009.tmp").mkdir()  # a save that not every rank finished
    (out / "checkpoint-00000009.tmp" / "__0_0.distcp").write_bytes(b"half")
    capsys.readouterr()
    train("train_fsdp.py", args(runs, out, "--resume"))
    assert "checkpoint-00000008 has no .metadata: not a complete checkpoint; falling back to checkpoint-00000004" \
        in capsys.readouterr().err
    assert not (out / "checkpoint-00000009.tmp").exists()
    assert_same_weights(out, reference, floor)


def test_an_unreadable_train_state_falls_back_to_the_older_checkpoint(runs, tmp_path, capsys):
    """Which checkpoint a resume starts from is decided before any shard is read: a newest one
    whose train_state.pt is torn is passed over, with a warning, for the next older one."""
    from training import sharded_checkpoint
    out = runs.copy(fsdp_two_ranks(runs), tmp_path / "run")
    state = out / "checkpoint-00000008" / "train_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    ckpt = sharded_checkpoint.load_latest_checkpoint(out)
    assert ckpt["step"] == 4 and ckpt["path"] == str(out / "checkpoint-00000004")
    assert capsys.readouterr().err.startswith(f"warning: cannot load checkpoint {state}: ")


@pytest.mark.parametrize("nproc", [2, 0])  # 0: `python train_fsdp.py`, a world of one
def test_a_full_disk_during_a_sharded_save_is_one_line_on_every_rank_and_leaves_no_temp_folder(runs, tmp_path, nproc):
    """The last rank's disk has room for one checkpoint and a half: its shard of step 8 fails
    with ENOSPC. Every rank exits 2, one line names the checkpoint and the disk (no DCP
    traceback on any rank; in one process it blamed metrics.jsonl), the partial
    checkpoint-00000008.tmp/ is removed (the disk would stay full), step 4's checkpoint is
    intact, and --resume, with space again, ends bitwise where an uninterrupted run ends."""
    reference = fsdp_two_ranks(runs) if nproc else runs("fsdp1", "train_fsdp.py")
    one_checkpoint = sum(f.stat().st_size for f in (reference / "checkpoint-00000004").iterdir())
    out, last_rank = tmp_path / "run", max(nproc, 1) - 1
    env = {**fault_env(tmp_path, "small-disk", step=0, rank=last_rank), "FAULT_BYTES": str(int(1.5 * one_checkpoint))}
    proc = run_script("train_fsdp.py", args(runs, out), nproc=nproc, wrapper="tests/inject_fault.py", env=env,
                      check=False)
    ours = [line for line in proc.stderr.splitlines() if line.startswith(("error: ", "[rank"))]  # not torchrun's
    assert len(ours) == 1 and ours[0].startswith(f"error: no space left to write {out}/checkpoint-00000008 (on the "
                                                 "disk mounted at /"), proc.stderr
    assert exit_codes(tmp_path) == {f"exit-rank{rank}": "2" for rank in range(last_rank + 1)}
    assert not list(out.glob("*.tmp")) and not (out / "model.pt").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-00000004"]
    run_script("train_fsdp.py", args(runs, out, "--resume"), nproc=nproc)
    assert_same_weights(out, reference)


def saved_after_every_step(runs):
    """2 ranks stopped at step 6 of 8, with a sharded checkpoint after each of steps 1 to 6."""
    return runs("fsdp2_every_step", "train_fsdp.py", ["--save-every", "1", "--keep-checkpoints", "6",
                                                      "--stop-at-step", "6"], nproc=2)


def test_crafted_or_damaged_sharded_checkpoints_run_no_code_and_are_passed_over(runs, tmp_path):
    """Every file in a checkpoint may be hostile. DCP itself would unpickle a crafted .metadata,
    and AdamW's values in a crafted shard, running their code on every rank; a shard missing
    or cut short, or an empty .metadata, would end the resume in a traceback. Each of the five
    newest checkpoints is one of these: the resume passes over each with a warning and
    finishes from the newest good one (step 1) exactly as the uninterrupted run did."""
    out = runs.copy(saved_after_every_step(runs), tmp_path / "run")
    ckpt = {step: out / f"checkpoint-{step:08d}" for step in range(1, 7)}
    ran = tmp_path / "the-code-ran"
    (ckpt[6] / ".metadata").write_bytes(pickle.dumps(RunsCode(ran)))
    # 5: its own .metadata, except that AdamW's lr is now read from a file that runs code
    metadata = pickle.loads((ckpt[5] / ".metadata").read_bytes())  # (the test's own copy: safe to unpickle)
    lr = next(index for index in metadata.storage_data if index.fqn.endswith(".lr"))
    torch.save(RunsCode(ran), ckpt[5] / "crafted.distcp")
    metadata.storage_data[lr] = _StorageInfo("crafted.distcp", 0, (ckpt[5] / "crafted.distcp").stat().st_size)
    (ckpt[5] / ".metadata").write_bytes(pickle.dumps(metadata))
    (ckpt[4] / "__1_0.distcp").unlink()
    shard = ckpt[3] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    (ckpt[2] / ".metadata").write_bytes(b"")
    proc = run_script("train_fsdp.py", args(runs, out, "--resume"), nproc=2)
    assert not ran.exists()
    assert f"resumed from {ckpt[1]} at step 1" in proc.stdout
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert [line.endswith("; falling back to checkpoint-00000001") for line in warned] == [True] * 5, warned
    for line, step, why in zip(warned, range(6, 1, -1), ["posix.system is not part of a checkpoint's metadata",
                                                         f"cannot load {lr.fqn} from {ckpt[5]}/crafted.distcp: "
                                                         "refused: it holds more than tensors and plain values",
                                                         "__1_0.distcp is missing", "__0_0.distcp is shorter",
                                                         "cannot read"]):
        assert str(ckpt[step]) in line and why in line, (line, why)
    assert "weights_only" not in proc.stderr  # torch's advice to load the crafted file unsafely is not passed on
    assert_same_weights(out, fsdp_two_ranks(runs))  # bitwise: resumed at the same world size
    assert not list(out.glob("*.tmp"))


def test_a_run_that_fell_back_never_prunes_its_way_down_to_the_unreadable_checkpoint(runs, tmp_path):
    """The newest checkpoint (6) unreadable and 5 gone: a resume falls back to 4, saves 5 and
    keeps one checkpoint. Pruning by count would keep only the unreadable 6; it prunes only
    checkpoints up to the one it saved, and names that one. The next resume passes over 6
    for 5 and ends where the uninterrupted run ended. (6's train_state.pt is crafted to run
    code: it runs none, and the warning does not pass on torch's advice to load it unsafely.)"""
    out = runs.copy(saved_after_every_step(runs), tmp_path / "run")
    ran = tmp_path / "the-code-ran"
    torch.save(RunsCode(ran), out / "checkpoint-00000006" / "train_state.pt")
    shutil.rmtree(out / "checkpoint-00000005")
    proc = run_script("train_fsdp.py", args(runs, out, "--resume", "--keep-checkpoints", "1", "--stop-at-step", "5"),
                      nproc=2)
    assert not ran.exists() and "weights_only" not in proc.stderr
    assert (f"warning: cannot load checkpoint {out}/checkpoint-00000006/train_state.pt: refused: it holds more than "
            "tensors and plain values") in proc.stderr
    assert f"checkpoint saved in {out}/checkpoint-00000005; continue with --resume" in proc.stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-00000005", "checkpoint-00000006"]
    proc = run_script("train_fsdp.py", args(runs, out, "--resume"), nproc=2)
    assert f"resumed from {out}/checkpoint-00000005 at step 5" in proc.stdout
    assert_same_weights(out, fsdp_two_ranks(runs))
    assert not list(out.glob("*.tmp"))  # no temp folder stays


@pytest.mark.compile
def test_compiled_fsdp_on_two_ranks_trains_the_same_model(runs, floor):
    """--compile under FSDP compiles each decoder layer before it is sharded: graphs are built
    on both ranks, and the model is the eager one to rounding."""
    compiled, spy = spied(runs, "fsdp2_compiled", "train_fsdp.py", ["--compile"], nproc=2)
    assert len(spy) == 2 and all(rank["compiled_graphs"] > 0 for rank in spy)
    assert_same_model(compiled, fsdp_two_ranks(runs), floor)


@pytest.mark.parametrize("script, run, message", [
    ("train_fsdp.py", "dp", "holds checkpoints of train_dp.py/train_ddp.py, not sharded ones: continue that run "
                            "with train_ddp.py"),
    ("train_ddp.py", "fsdp2", "holds sharded checkpoints of train_fsdp.py or train_tp.py: continue that run with "
                              "either"),
    ("train_dp.py", "fsdp2", "holds sharded checkpoints of train_fsdp.py"),
])
def test_a_run_of_the_other_kind_is_refused_and_left_untouched(runs, tmp_path, script, run, message, capsys):
    out = tmp_path / "run"
    shutil.copytree(fsdp_two_ranks(runs) if run == "fsdp2" else runs("dp", "train_dp.py"), out)
    refused_in_process(script, ["--dataset", str(runs.corpus), *FAST, "--resume"], out, message, capsys)


def test_bf16_under_fsdp_learns_trains_the_same_model_on_two_ranks_as_on_one_and_saves_fp32_weights(runs,
                                                                                                   bf16_floor):
    """FSDP's bf16 differs from autocast's by design (conftest.BF16_MULTIPLE), so the
    reference is FSDP's bf16 in a world of one: the same arithmetic, added in another order."""
    out, spy = spied(runs, "fsdp2_bf16", "train_fsdp.py", BF16, nproc=2)
    assert [rank["matmul_dtypes"] for rank in spy] == [["bfloat16"]] * 2  # the flag took effect on both ranks
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


def test_a_sharded_save_waits_for_the_other_ranks_no_longer_than_a_training_collective(world_of_one, tmp_path):
    """The writer's collectives run on a gloo group of its own, bounded by --timeout-minutes
    (not by --data-timeout-minutes, a day, which bounds data preparation): a rank that dies
    mid-save must not hold the others' exit for a day."""
    from training import sharded_checkpoint
    writer = sharded_checkpoint.ShardedCheckpointWriter(str(tmp_path), keep=2, timeout_minutes=7)
    assert writer.group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(minutes=7)
    assert writer.group != world_of_one  # nor the group of anything else


def test_a_sharded_save_builds_no_cuda_loader_in_dcps_writer_thread(world_of_one, tmp_path, monkeypatch):
    """With CUDA available, DCP's writer by default copies tensors ahead from a GPU on the
    current stream of its own thread, which is GPU 0's whatever the rank's GPU: every rank
    would open a CUDA context on GPU 0. Our shards are staged in CPU memory before the thread
    starts, so no such loader may be built. CUDA's presence is faked: the spy sees the choice."""
    import threading

    from torch.distributed.checkpoint import filesystem
    from torch.distributed.device_mesh import init_device_mesh

    from training import sharded_checkpoint
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
    # one real step first: with no state yet, the save would take an AdamW step itself, and a
    # CUDA build of torch on a machine without a GPU, told CUDA is there, would look for one
    ids = torch.randint(0, 97, (1, 8))
    model(ids, ids)[0].sum().backward()
    optimizer.step()
    writer = sharded_checkpoint.ShardedCheckpointWriter(str(tmp_path), keep=2, timeout_minutes=1)
    monkeypatch.setattr(filesystem._OverlappingCpuLoader, "__init__", spy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    writer.save(model, optimizer, {"step": 1})
    writer.wait()  # re-raises what failed in the background
    monkeypatch.undo()
    assert built_in == []
    assert sorted(p.name for p in (tmp_path / "checkpoint-00000001").iterdir()) == [
        ".metadata", "__0_0.distcp", "train_state.pt"]


def test_shard_makes_each_layer_the_embedding_and_the_norm_with_the_head_a_unit_gathered_in_the_compute_dtype(
        world_of_one):
    """train_fsdp.shard's units, as the README and docs/fsdp.md list them: each decoder layer,
    the embedding, and the final norm with the LM head (one unit: backward starts with both),
    then the root, which holds no weight of its own. Each unit is freed after its forward and
    gathered again for backward, except the norm with the head, which backward needs first:
    kept gathered. Every unit gathers in the compute dtype and reduces gradients in fp32 into
    fp32 shards. None of this shows in a loss (a unit fewer, or gradients reduced in bf16,
    train nearly the same model), so it is read from FSDP's own state (private: torch 2.13's
    names)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    import train_fsdp
    from model import LlamaConfig, LlamaForPretraining
    if not hasattr(FSDPModule, "_get_fsdp_state"):  # private state: on another torch, other names
        pytest.skip(f"reads FSDP2's private state by the names of torch 2.13, which torch {torch.__version__} lacks")
    model_config = LlamaConfig(vocab_size=97, max_position_embeddings=32, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForPretraining(model_config)
    train_fsdp.shard(model, init_device_mesh("cpu", (1,)), torch.bfloat16)
    name = {module: name for name, module in model.named_modules()}
    units = {}
    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not model:
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            units[tuple(name[m] for m in state._modules)] = (
                len(group.fsdp_params), group.post_forward_mesh_info is not None,  # None: kept gathered
                group.mp_policy.param_dtype, group.mp_policy.reduce_dtype)
    resharded = (9, True, torch.bfloat16, torch.float32)  # a layer: 4 attention, 3 MLP matrices, 2 norms
    assert units == {("base_model.layers.0",): resharded, ("base_model.layers.1",): resharded,
                     ("base_model.embed_tokens",): (1, True, torch.bfloat16, torch.float32),
                     ("base_model.norm", "lm_head"): (2, False, torch.bfloat16, torch.float32)}
    assert isinstance(model, FSDPModule) and model._get_fsdp_state()._fsdp_param_group is None  # the root


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


def test_fsdp_builds_no_whole_model_and_draws_the_initial_weights_of_one_process(tmp_path):
    """train_fsdp.py builds the model on the meta device, shards it, and gives each rank
    memory for its shards alone; every rank then draws each whole weight in turn and keeps
    its part. Gathered whole again, the weights are bitwise those one process (DP, DDP) starts
    from, and the RoPE tables are computed again in the fresh memory."""
    found = tmp_path / "found.json"
    # real: its ranks end with os._exit, and a forked rank's torchrun waits for its return value
    run_script("tests/fsdp_initial_weights.py", [str(found)], nproc=2, real_torchrun=True)
    result = json.loads(found.read_text())
    assert result["on_meta"] and result["names_equal"] and result["differ"] == [] and result["rope"]
    assert result["local"] <= result["total"] // 2 + 1_000  # this rank's half (a shard of uneven rows rounds up)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)], ids=["eager", "compiled"])
def test_layers_kept_gathered_keeps_the_last_layers_alone_gathered_into_backward_and_trains_the_same_model(
        tmp_path, compiled):
    """train_fsdp.shard's candidate (0 by default), on 2 ranks: with layers_kept_gathered 1, after
    forward and until backward, the last decoder layer's parameters are its gathered weights, as
    the norm's and LM head's are; every other layer's are its shards again, as without it; with
    2, every layer's. Backward reshards
    them all. Three steps with clipping acting, and an evaluation forward after each (whose
    kept units no backward reshards), log the same losses and gradient norms and end with the
    same weights as the default, bitwise: the same gathered values, used without gathering
    them again. Eager, and with each layer compiled before sharding, as --compile does."""
    found = tmp_path / "found.json"
    # real: its ranks end with os._exit, and a forked rank's torchrun waits for its return value
    run_script("tests/fsdp_layers_kept_gathered.py", [str(found), *(["compile"] if compiled else [])], nproc=2,
               real_torchrun=True)
    result = json.loads(found.read_text())
    plain, kept, all_kept = result["plain"], result["kept"], result["all kept"]
    rest = ["base_model.embed_tokens", "base_model.layers.0", "base_model.layers.1"]  # the debug model's 2 layers
    head = {"base_model.norm": "gathered", "lm_head": "gathered"}
    assert plain["after forward"] == {**dict.fromkeys(rest, "sharded"), **head}
    assert kept["after forward"] == {**dict.fromkeys(rest[:2], "sharded"), rest[2]: "gathered", **head}
    assert all_kept["after forward"] == {rest[0]: "sharded", **dict.fromkeys(rest[1:], "gathered"), **head}
    for run in (plain, kept, all_kept):
        assert run["after backward"] == dict.fromkeys([*rest, *head], "sharded")
    assert min(plain["grad norms"]) > 0.05  # --grad-clip 0.05: clipping acts at every step
    for run in (kept, all_kept):
        assert run["losses"] == plain["losses"] and run["grad norms"] == plain["grad norms"]
    assert result["differ"] == {"plain": [], "kept": [], "all kept": []}
    assert result["weights"] == 21  # every weight of the model, bitwise


def test_train_fsdp_gives_fully_shard_a_model_that_has_no_memory_yet(runs, tmp_path, monkeypatch):
    """The test above proves the procedure in a script of its own; this one that train_fsdp.py
    follows it: every unit it shards is still on the meta device (shapes, no memory), so no
    rank ever holds the whole model. Built whole first, as DDP builds it, the model would be
    the same (to_empty, then the same draws): only each rank's peak memory would show it."""
    from torch.distributed import fsdp
    real_fully_shard, on_meta = fsdp.fully_shard, []

    def spy(module, *args, **kwargs):
        modules = module if isinstance(module, list) else [module]  # the norm with the LM head: one unit of two
        on_meta.append(all(p.is_meta for m in modules for p in m.parameters()))
        return real_fully_shard(module, *args, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)  # what train_fsdp.py imports when it runs
    train("train_fsdp.py", args(runs, tmp_path / "run", "--max-steps", "1"))
    assert on_meta == [True] * (PRESETS[MODEL]["num_hidden_layers"] + 3)  # the layers, embedding, norm with head, root


def test_every_rank_of_train_fsdp_runs_as_many_evaluation_forwards(runs):
    """The test below proves val_loader's padding row; this one that train_fsdp.py asks for it.
    With one held-out row a rank and forward (--grad-accum 4 on 2 ranks: a micro-batch of 1),
    an odd number of rows would give rank 1 one forward fewer than rank 0, and rank 0's last
    forward would wait in its gathers for collectives rank 1 never makes: the run would hang
    until --timeout-minutes (1 here) ran out. (With the tests' usual micro-batch of 4, 12 and 11
    rows make 3 batches each: the padding goes unseen.)"""
    out, spies = spied(runs, "fsdp2_accum4", "train_fsdp.py", ["--grad-accum", "4", "--timeout-minutes", "1"], nproc=2)
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out)])
    _, val_text, _ = run_data.load_text(cfg)
    tokenizer = tokenized.load_tokenizer(out / "tokenizer.json")
    rows = len(tokenized.tokenize(val_text, tokenizer, cfg.seq_len))
    assert rows % 2 == 1  # rank 0 holds one row more
    assert [spy["evaluation_batches"] for spy in spies] == [[(rows + 1) // 2] * 2] * 2  # at steps 4 and 8


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_every_rank_runs_as_many_evaluation_forwards_when_the_held_out_rows_do_not_split_evenly(pack):
    """Each FSDP forward all-gathers every layer: a rank with one held-out row fewer would run
    one forward fewer, and its next collectives would pair with the others' evaluation. So
    train_fsdp.py's val_loader (same_length) gives it a row of padding, whose targets are all
    ignored: the same number of batches on every rank, and every real target once."""
    import data
    from training import evaluation, packing
    from model import IGNORE_INDEX
    from test_packing import stored_windows
    windows = stored_windows([12, 30, 33, 7, 20, 33, 15, 9, 26, 18], vocab_size=300)  # 5 windows are kept
    ds = data.PaddedSequenceDataset(windows, 32, pad_id=0)
    if pack:
        ds = packing.PackedSequenceDataset(windows, 32, pad_id=0, packing=packing.pack(windows, 32, seed=0))
    assert len(ds) % 2 == 1  # uneven over 2 ranks
    loaders = [list(evaluation.val_loader(ds, rank, 2, batch_size=2, same_length=True)) for rank in (0, 1)]
    assert len(loaders[0]) == len(loaders[1])
    assert [sum(len(batch[0]) for batch in loader) for loader in loaders] == [len(ds) // 2 + 1] * 2
    targets = sum(int((batch[1] != IGNORE_INDEX).sum()) for loader in loaders for batch in loader)
    assert targets == int(ds.targets.sum())
