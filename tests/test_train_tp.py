"""train_tp.py: tensor parallelism over "tp" and FSDP over "dp" train the model DDP trains on
the same global batches, at every layout of the ranks; its checkpoints resume exactly at the
same layout and within rounding at another, train_fsdp.py's too. (The plan itself, on two
ranks against the whole model: test_tensor_parallel.py.)"""

import pickle
import re
import shutil

import pytest

import test_stream_training
from test_bad_inputs import refused_in_process
from test_failures import exit_codes, fault_env
from conftest import (BF16, FAST, FLOOR_MULTIPLE, assert_follows_in_bf16, assert_same_model, assert_same_weights, assert_within,
                      ddp_two_ranks, metrics, run_script)
from training import config
from training.errors import UsageError

LAYOUTS = {"dp1_tp2": (2, ["--tp", "2"]), "dp2_tp2": (4, ["--tp", "2"]), "dp2_tp1": (2, ["--tp", "1"])}


def base_args(runs, out):
    return ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out)]


def tp_run(runs, layout: str, *extra: str):
    nproc, flags = LAYOUTS[layout]
    name = "tp_" + layout + "".join(e.strip("-").replace("-", "_") for e in extra)
    return runs(name, "train_tp.py", [*flags, *extra], nproc=nproc)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_trains_the_model_ddp_trains_on_the_same_global_batches(runs, floor, layout):
    """(dp 1, tp 2), (dp 2, tp 2) and (dp 2, tp 1) against DDP on 2 ranks: the same weights and
    logged losses within the rounding floor (TP adds each row-parallel output up from its
    shares, FSDP its gradient norms from their shards: other orders, not other sums). The
    logged gradient norms too: AdamW would hide gradients scaled by a constant (a loss summed
    over TP peers), unclipped."""
    tp, ddp = tp_run(runs, layout), ddp_two_ranks(runs)
    assert_same_model(tp, ddp, floor)
    norms = [[row["grad_norm"] for row in metrics(run) if "grad_norm" in row] for run in (tp, ddp)]
    assert len(norms[0]) == len(norms[1]) == 4
    assert_within("gradient norms", max(abs(a - b) / b for a, b in zip(*norms)), floor.loss, FLOOR_MULTIPLE)


def unfinished(run, to):
    """A copy of a finished run as it stood at step 4: its checkpoint-00000008 and model.pt taken away."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoint-00000008")
    (to / "model.pt").unlink()
    return to


def test_stopped_and_resumed_at_the_same_layout_it_trains_the_same_model_bitwise(runs, tmp_path):
    """(dp 2, tp 2) resumed at step 4 by (dp 2, tp 2): every rank reads back its own shares, and
    the run goes on as if never stopped: the same weights and logged rows, to the bit."""
    reference = tp_run(runs, "dp2_tp2")
    half = unfinished(reference, tmp_path / "run")
    proc = run_script("train_tp.py", [*base_args(runs, half), "--tp", "2", "--resume"], nproc=4)
    assert f"resumed from {half}/checkpoint-00000004 at step 4" in proc.stdout
    assert_same_model(half, reference)


def test_a_checkpoint_resumes_at_every_other_layout_and_in_train_fsdp_and_back(runs, tmp_path, floor):
    """A checkpoint of (dp 2, tp 2) at step 4, resumed by (dp 1, tp 2) to step 6, whose checkpoint
    (dp 2, tp 1) resumes to the end: DCP reshards each tensor to each layout, and the data goes
    on at the same global batch (its position is the step, whatever the data-parallel degree).
    Then the same checkpoint into train_fsdp.py on 2 ranks, and train_fsdp.py's at step 4 into
    (dp 1, tp 2). Each within the rounding floor of the uninterrupted DDP run."""
    ddp = ddp_two_ranks(runs)
    chain = unfinished(tp_run(runs, "dp2_tp2"), tmp_path / "chain")
    run_script("train_tp.py", [*base_args(runs, chain), "--tp", "2", "--resume", "--stop-at-step", "6"], nproc=2)
    assert (chain / "checkpoint-00000006").is_dir() and not (chain / "model.pt").exists()
    proc = run_script("train_tp.py", [*base_args(runs, chain), "--tp", "1", "--resume"], nproc=2)
    assert f"resumed from {chain}/checkpoint-00000006 at step 6" in proc.stdout
    assert_same_weights(chain, ddp, floor)  # (its rows: a stop at step 6 logs a val loss there too)
    into_fsdp = unfinished(tp_run(runs, "dp2_tp2"), tmp_path / "into-fsdp")
    run_script("train_fsdp.py", [*base_args(runs, into_fsdp), "--resume"], nproc=2)
    assert_same_model(into_fsdp, ddp, floor)
    from_fsdp = unfinished(runs("fsdp2_plain", "train_fsdp.py", nproc=2), tmp_path / "from-fsdp")
    run_script("train_tp.py", [*base_args(runs, from_fsdp), "--tp", "2", "--resume"], nproc=2)
    assert_same_model(from_fsdp, ddp, floor)


def test_a_checkpoint_whose_metadata_leaves_out_a_tp_piece_is_refused_not_resumed_half_fresh(runs, tmp_path, capsys):
    """A .metadata edited (or damaged) to name one of q_proj's two TP pieces: DCP would load the
    half it names and leave the other as the fresh model drew it, resuming without a word (2.6e-3
    from the uninterrupted run's weights at the end). Each tensor's pieces must cover it once:
    one line, exit 2, the run untouched, here resumed at another layout (one process, --tp 1)."""
    out = unfinished(tp_run(runs, "dp1_tp2"), tmp_path / "run")
    metadata_file = out / "checkpoint-00000004" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # (the test's own copy: safe to unpickle)
    name = "model.base_model.layers.0.self_attn.q_proj.weight"
    left_out = metadata.state_dict_metadata[name].chunks.pop(1)  # rows 32 to 63, TP rank 1's
    del metadata.storage_data[next(i for i in metadata.storage_data if i.fqn == name and i.offset == left_out.offsets)]
    metadata_file.write_bytes(pickle.dumps(metadata))
    refused_in_process("train_tp.py", ["--dataset", str(runs.corpus), *FAST, "--resume"], out,
                       f"{metadata_file}: base_model.layers.0.self_attn.q_proj.weight's pieces do not add up to its "
                       "shape (64, 64): the checkpoint is damaged", capsys)


def test_train_ddp_refuses_a_train_tp_run_naming_the_scripts_that_resume_it(runs, tmp_path, capsys):
    """A train_tp.py run is not train_fsdp.py's alone: the refusal names both, as either resumes it."""
    out = unfinished(tp_run(runs, "dp1_tp2"), tmp_path / "run")
    refused_in_process("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--resume"], out,
                       "holds sharded checkpoints of train_fsdp.py or train_tp.py: continue that run with either", capsys)


@pytest.mark.parametrize("layout", ["dp1_tp2", "dp2_tp2"])
def test_packed_rows_train_the_model_ddp_trains(runs, floor, layout):
    """--pack: each rank attends over its share of the heads with the windows' own mask."""
    assert_same_model(tp_run(runs, layout, "--pack"), runs("ddp2_pack", "train_ddp.py", ["--pack"], nproc=2), floor)


def test_activation_checkpointing_recomputes_the_split_layers_to_the_same_model(runs, floor):
    assert_same_model(tp_run(runs, "dp1_tp2", "--activation-checkpointing"), ddp_two_ranks(runs), floor)


@pytest.mark.compile
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_compiled_tp_trains_the_model_eager_ddp_trains(runs, floor, pack):
    """--compile: each layer compiled with its TP hooks inside. The residual stream as plain
    tensors viewed out of DTensors compiled to weights 4.1e-3 from eager on torch 2.14.1, and
    the vocabulary-parallel loss compiled, packed rows to 8.0e-3."""
    compiled = tp_run(runs, "dp1_tp2", "--compile", *(["--pack"] if pack else []))
    eager = runs("ddp2_pack", "train_ddp.py", ["--pack"], nproc=2) if pack else ddp_two_ranks(runs)
    assert_same_model(compiled, eager, floor)


def test_bf16_trains_the_model_fsdp_trains_in_bf16(runs, bf16_floor):
    """bf16 (MixedPrecisionPolicy, as train_fsdp.py): (dp 2, tp 2) follows FSDP on 2 ranks in bf16
    within the bf16 floor; the loss over the vocabulary's shards in fp32 as the plain one is."""
    fsdp = runs("fsdp2_short_bf16", "train_fsdp.py", BF16, nproc=2)
    assert_follows_in_bf16(tp_run(runs, "dp2_tp2", *BF16), fsdp, bf16_floor)


@pytest.mark.compile
def test_compiled_bf16_trains_the_model_fsdp_trains_in_bf16(runs, bf16_floor):
    fsdp = runs("fsdp2_short_bf16", "train_fsdp.py", BF16, nproc=2)
    assert_follows_in_bf16(tp_run(runs, "dp1_tp2", "--compile", *BF16), fsdp, bf16_floor)


# ---------------------------------------------------------------------------------------
# --stream: each data-parallel group reads its own sub-streams, its TP ranks the same ones


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return test_stream_training.shards.__wrapped__(tmp_path_factory)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, shards):
    return test_stream_training.streamed.__wrapped__(tmp_path_factory, shards)


@pytest.fixture(scope="module")
def stream_floor(streamed):
    return test_stream_training.stream_floor.__wrapped__(streamed)


@pytest.mark.parametrize("layout", ["dp1_tp2", "dp2_tp2"])
def test_streamed_every_layout_trains_the_model_ddp_trains(streamed, stream_floor, layout):
    """(dp 1, tp 2) and (dp 2, tp 2) stream the model DDP on 2 ranks streams, within the floor
    (2 and 4 sub-streams a group)."""
    nproc = LAYOUTS[layout][0]
    tp = streamed(f"tp_{layout}", "train_tp.py", ["--tp", "2"], nproc=nproc)
    test_stream_training.assert_same_training(tp, streamed("ddp2", "train_ddp.py", nproc=2), stream_floor)


def test_streamed_and_stopped_it_resumes_at_another_layout(streamed, tmp_path, stream_floor):
    """(dp 2, tp 2) stopped at step 10 resumes at (dp 1, tp 2) to the end, every sub-stream taken
    from where the checkpoint left it: DDP's model on 2 ranks, within the floor."""
    ddp = streamed("ddp2", "train_ddp.py", nproc=2)
    out = tmp_path / "run"
    run_script("train_tp.py", test_stream_training.args(streamed, out, "--tp", "2", "--stop-at-step", "10"), nproc=4)
    run_script("train_tp.py", test_stream_training.args(streamed, out, "--tp", "2", "--resume"), nproc=2)
    test_stream_training.assert_same_training(out, ddp, stream_floor)


def test_streamed_and_stopped_it_resumes_bitwise_at_the_same_layout_and_within_the_floor_in_train_fsdp(
        streamed, tmp_path, stream_floor):
    """(dp 1, tp 2) stopped at step 10 (its sub-streams' positions in train_state.pt): resumed at
    (1, 2) it ends bitwise where the uninterrupted run ends; resumed by train_fsdp.py on 2 ranks,
    each rank then owning sub-streams of its own, within the floor."""
    reference = streamed("tp_dp1_tp2", "train_tp.py", ["--tp", "2"], nproc=2)
    stopped = streamed("tp_dp1_tp2_stop10", "train_tp.py", ["--tp", "2", "--stop-at-step", "10"], nproc=2)
    same, fsdp = streamed.copy(stopped, tmp_path / "same"), streamed.copy(stopped, tmp_path / "fsdp")
    run_script("train_tp.py", test_stream_training.args(streamed, same, "--tp", "2", "--resume"), nproc=2)
    test_stream_training.assert_bitwise(same, reference)
    run_script("train_fsdp.py", test_stream_training.args(streamed, fsdp, "--resume"), nproc=2)
    test_stream_training.assert_same_training(fsdp, reference, stream_floor)


def test_sub_streams_that_the_data_parallel_groups_cannot_share_are_named_as_groups_not_ranks(streamed, tmp_path):
    """4 ranks at --tp 2 read as 2 data-parallel groups, which cannot share 3 sub-streams: the
    line counts groups, as a count of ranks ("runs at 1, 3 ranks") would send the user to 3
    ranks, which --tp 2 refuses."""
    refused_on_every_rank(tmp_path, 4, ["--dataset", str(streamed.shards), *test_stream_training.STREAM, "--tp", "2",
                                        "--sub-streams", "3", "--batch-size", "6"],
                          "2 data-parallel groups (ranks / --tp 2) cannot share the run's 3 sub-streams evenly: it "
                          "runs and resumes at 1, 3 data-parallel groups (ranks / --tp 2)")


# ---------------------------------------------------------------------------------------
# What TP cannot split: one line, exit 2, before anything is written


def test_a_tp_that_does_not_divide_the_ranks_is_one_line(runs, tmp_path, capsys):
    refused_in_process("train_tp.py", ["--dataset", str(runs.corpus), *FAST, "--tp", "2"], tmp_path / "out",
                       "--tp 2 does not divide the 1 ranks", capsys)


@pytest.mark.parametrize("nproc, extra, message", [
    (2, ["--seq-len", "33"], "--tp 2: --seq-len 33 does not split into 2 equal parts"),
    (4, ["--tp", "4"], "--tp 4: the model's 2 key/value heads do not split into 4 equal shares; choose a --tp that "
                       "divides 2, or another --model"),
], ids=["seq-len", "kv-heads"])
def test_what_tp_cannot_split_is_one_line_on_every_rank_and_the_out_dir_untouched(runs, tmp_path, nproc, extra,
                                                                                  message):
    """Through the real torchrun: the ranks exit 2 with the same line, printed once, and no
    --out-dir is made (the model's shapes are checked once the vocabulary is known, before
    anything is written)."""
    refused_on_every_rank(tmp_path, nproc, ["--dataset", str(runs.corpus), *FAST, "--tp", "2", *extra], message)


def test_a_global_batch_the_data_parallel_groups_cannot_split_counts_groups_not_ranks(runs):
    """4 ranks at --tp 2 are 2 data-parallel groups, not "world size 2", as the line said. (In this
    process: under torchrun this refusal comes before the ranks meet, and torchrun may end the
    others before they record their exit.)"""
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST, "--tp", "2", "--batch-size", "5"], tensor=True)
    with pytest.raises(UsageError, match=re.escape("--batch-size 5 is not divisible by 2 data-parallel groups "
                                                   "(ranks / --tp 2) x --grad-accum 1")):
        config.micro_batch_size(cfg, 2)


def refused_on_every_rank(tmp_path, nproc: int, args: list[str], message: str):
    """Every rank that recorded its end exited 2 (a refusal before the ranks meet may see torchrun
    end the others first, once one has exited), and at least one did; the line printed once."""
    out = tmp_path / "out"
    proc = run_script("train_tp.py", [*args, "--out-dir", str(out)], nproc=nproc, wrapper="tests/inject_fault.py",
                      check=False, env=fault_env(tmp_path, "none", step=0))
    ended = exit_codes(tmp_path)
    assert ended and set(ended.values()) == {"2"}, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and message in ours[0], proc.stderr
    assert not out.exists()
