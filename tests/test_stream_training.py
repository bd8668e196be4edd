"""--stream through the scripts: streamed runs train the same model on train_dp.py, on DDP at
1, 2 and 4 ranks and on FSDP; a run killed with kill -9 (or stopped) resumes bitwise at the
same world size, in the corpus's first epoch and in its second; and at another world size
(4 -> 2 -> 1, 2 -> 4) it trains the same global batches, its weights within the rounding floor
of the uninterrupted run's (conftest.FLOOR_MULTIPLE), the floor measured on these runs.

The corpus: 6 parquet shards of 8 documents in row groups of 3 (the last of each a group of
2), the first 9 documents held out, the rest dealt into 4 sub-streams (--sub-streams 4: every
world size here divides it). Small enough that --max-steps 20 reads it more than once: with
--seed 0, padded, every sub-stream reads its first epoch until step 12 and its second from
step 14 to 24; packed (rows of several windows, so fewer rows an epoch), its first until step 7
and its second from step 9 to 14. Checkpoints every 4 steps: step 4 stands in the first
epoch, step 16 (padded) and step 12 (packed) in the second. The tests check the epochs in the
checkpoints themselves (each sub-stream's cursor), so that a change of the corpus, the deal or
the tokenizer cannot make them test another epoch in silence."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import (FLOOR_MULTIPLE, REVERSED, assert_learns, assert_same_model, assert_same_weights, assert_within,
                      exclusive, load_weights, max_weight_diff, measure_floor, memoized_runs, metrics, run_script,
                      shared_dir, train, without_speed, write_corpus)
from test_failures import exit_codes, fault_env

SHARDS, DOCUMENTS, ROW_GROUP = 6, 8, 3
# Every step logged: a run stopped at any step logs the rows the uninterrupted run logs. Every
# checkpoint kept: the tests read the sub-streams' positions in them.
STREAM = ["--stream", "--sub-streams", "4", "--seed", "0", "--model", "debug", "--vocab-size", "300", "--seq-len", "32",
          "--batch-size", "8", "--max-steps", "20", "--warmup-steps", "2", "--log-every", "1", "--eval-every", "10",
          "--save-every", "4", "--keep-checkpoints", "9", "--val-docs", "9", "--dtype", "fp32", "--device", "cpu"]
PACK = ["--pack"]
FIRST_EPOCH_STEP = 4  # a checkpoint in the first epoch, mid-way
SECOND_EPOCH_STEP = {False: 16, True: 12}  # a checkpoint in the second epoch, padded and packed


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """SHARDS parquet files of DOCUMENTS documents each (conftest.write_corpus's: 3 to 40 words,
    some longer than --seq-len 32, cut into several windows), in row groups of ROW_GROUP."""
    folder = shared_dir(tmp_path_factory) / "stream-shards"
    with exclusive(folder.with_suffix(".lock")):
        if not folder.exists():
            lines = write_corpus(folder.with_suffix(".txt"), SHARDS * DOCUMENTS).read_text().splitlines()
            building = folder.with_suffix(".tmp")
            building.mkdir()
            for i in range(SHARDS):
                texts = pa.array(lines[i * DOCUMENTS:(i + 1) * DOCUMENTS], pa.string())
                pq.write_table(pa.table({"text": texts}), building / f"shard-{i}.parquet", row_group_size=ROW_GROUP)
            building.rename(folder)
    return folder


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, shards):
    """Memoized streamed runs (as conftest's `runs`): streamed(name, script, extra, nproc) -> out_dir."""
    get = memoized_runs(shared_dir(tmp_path_factory) / "stream-runs", ["--dataset", str(shards), *STREAM])
    get.shards = shards
    return get


def args(streamed, out, *extra) -> list[str]:
    return ["--dataset", str(streamed.shards), *STREAM, "--out-dir", str(out), *extra]


@pytest.fixture(scope="module")
def stream_floor(streamed):
    """The rounding floor of these runs: train_dp.py's, against the same run with every
    micro-batch's rows in reverse order (conftest.measure_floor)."""
    return measure_floor(streamed("dp", "train_dp.py"), streamed("dp_reversed", "train_dp.py", **REVERSED))


def checkpoint(out, step: int) -> dict:
    name = f"checkpoint-{step:08d}"
    path = out / name / "train_state.pt" if (out / name).is_dir() else out / f"{name}.pt"  # FSDP's is a folder
    return torch.load(path, map_location="cpu", weights_only=True)


def sub_streams_at(out, step: int) -> dict[int, dict]:
    """Each sub-stream's state in the checkpoint of `step`: {sub-stream: SubStreamRows.state_dict()}."""
    return checkpoint(out, step)["stream"]["states"]


def epochs_at(out, step: int) -> list[int]:
    """The epoch each sub-stream reads at the checkpoint of `step` (0: the corpus's first)."""
    return [state["cursor"]["epoch"] for _, state in sorted(sub_streams_at(out, step).items())]


def killed(streamed, tmp_path, step: int, after_checkpoint: int, *extra, nproc: int = 2, rank: int = 1):
    """A DDP run of `nproc` ranks whose rank `rank` is killed with kill -9 in `step` (once the
    checkpoint of `after_checkpoint` is on disk); torchrun restarts every rank, and they resume
    from that checkpoint and finish the run. Returns its folder."""
    out = tmp_path / "run"
    env = {**fault_env(tmp_path, "kill", step=step, rank=rank),
           "FAULT_AFTER_FILE": str(out / f"checkpoint-{after_checkpoint:08d}.pt")}
    proc = run_script("train_ddp.py", args(streamed, out, *extra), nproc=nproc, wrapper="tests/inject_fault.py",
                      env=env, torchrun_args=["--max-restarts=1"])
    assert f"resumed from {out}/checkpoint.pt at step {after_checkpoint} (restart 1)" in proc.stdout
    assert exit_codes(tmp_path) == {f"exit-rank{r}": "0" for r in range(nproc)}  # the restarted attempt
    return out


def assert_bitwise(run, reference):
    """The same weights, bit for bit, and the same logged rows (timings aside: tokens seen included)."""
    assert max_weight_diff(load_weights(run), load_weights(reference)) == 0.0
    assert without_speed(metrics(run)) == without_speed(metrics(reference))


def assert_same_training(run, reference, floor):
    """Another world size, the same global batches: the weights within the rounding floor, and
    the same training rows logged (steps, learning rates, tokens seen: exactly; the losses
    within the floor). A run stopped with --stop-at-step also evaluates where it stopped: the
    held-out rows are not compared."""
    assert_same_weights(run, reference, floor)
    rows = [[row for row in metrics(r) if "loss" in row] for r in (run, reference)]
    apart = ("loss", "grad_norm")  # grad_norm: a norm rounds apart from the losses
    assert without_speed(rows[0], leave_out=apart) == without_speed(rows[1], leave_out=apart)
    distance = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(*rows))
    assert_within("losses", distance, floor.loss, FLOOR_MULTIPLE)


# ---------------------------------------------------------------------------------------
# Every script streams, and at every world size trains the same model


def test_streamed_runs_train_the_same_model_on_dp_on_ddp_at_1_2_and_4_ranks_and_on_fsdp(streamed, stream_floor):
    """The global batch is the same rows at every world size that divides the sub-streams:
    train_dp.py, DDP at 1, 2 and 4 ranks and FSDP at 2 train the same model, within the
    rounding floor; and it learns."""
    dp = streamed("dp", "train_dp.py")
    assert_learns(metrics(dp))
    for name, script, nproc in [("ddp1", "train_ddp.py", 0), ("ddp2", "train_ddp.py", 2),
                                ("ddp4", "train_ddp.py", 4), ("fsdp2", "train_fsdp.py", 2)]:
        assert_same_model(streamed(name, script, nproc=nproc), dp, stream_floor)


def test_each_epoch_deals_the_pieces_anew(streamed):
    """--seed and the epoch decide the order: every sub-stream reads other pieces in the
    corpus's second epoch than in its first (each cursor names its epoch's pieces by a hash)."""
    run = streamed("ddp2", "train_ddp.py", nproc=2)
    first, second = sub_streams_at(run, FIRST_EPOCH_STEP), sub_streams_at(run, SECOND_EPOCH_STEP[False])
    assert epochs_at(run, FIRST_EPOCH_STEP) == [0] * 4 and epochs_at(run, SECOND_EPOCH_STEP[False]) == [1] * 4
    for stream in range(4):
        assert first[stream]["cursor"]["dealt"] != second[stream]["cursor"]["dealt"], stream


# ---------------------------------------------------------------------------------------
# Resumed at the same world size: bitwise


def test_train_dp_stopped_mid_epoch_resumes_bitwise(streamed, tmp_path):
    """train_dp.py stopped at step 10 (--stop-at-step: the checkpoint holds every sub-stream's
    position, mid-document where a document has several windows) and resumed ends bitwise where
    the uninterrupted run ends, with the same metrics.jsonl."""
    out = tmp_path / "run"
    train("train_dp.py", args(streamed, out, "--stop-at-step", "10"))
    assert epochs_at(out, 10) == [0] * 4 and any(state["window"] for state in sub_streams_at(out, 10).values())
    train("train_dp.py", args(streamed, out, "--resume"))
    assert_bitwise(out, streamed("dp", "train_dp.py"))


def test_ddp_killed_mid_epoch_resumes_bitwise(streamed, tmp_path):
    """kill -9 of a lone DDP rank in step 6, in the corpus's first epoch: torchrun restarts it,
    and it resumes from the step-4 checkpoint (every sub-stream part-way through its first
    epoch) and ends bitwise where the uninterrupted run ends. With a core to spare, a
    DataLoader worker reads its sub-streams: killed with it, the worker must not keep the
    restarted run out of its --out-dir (it shared the folder's lock, and lived on for seconds)."""
    out = killed(streamed, tmp_path, 6, FIRST_EPOCH_STEP, nproc=1, rank=0)
    states = sub_streams_at(out, FIRST_EPOCH_STEP).values()
    assert epochs_at(out, FIRST_EPOCH_STEP) == [0] * 4 and any(state["window"] for state in states)
    assert all(state["cursor"]["piece"] or state["cursor"]["row"] for state in states)  # none at its start
    assert_bitwise(out, streamed("ddp1", "train_ddp.py"))


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_ddp_killed_in_the_second_epoch_resumes_bitwise(streamed, tmp_path, pack):
    """kill -9 of rank 1 two steps after a checkpoint at which every sub-stream reads the
    corpus's second epoch: resumed from it, the run ends bitwise where the uninterrupted one
    ends. Packed, each sub-stream's packer holds open rows at the checkpoint: the resume has
    them from the checkpoint alone."""
    extra = PACK if pack else []
    at = SECOND_EPOCH_STEP[pack]
    out = killed(streamed, tmp_path, at + 2, at, *extra)
    assert epochs_at(out, at) == [1] * 4
    if pack:
        assert all(state["packer"]["windows"] for state in sub_streams_at(out, at).values())
    assert_bitwise(out, streamed("ddp2_packed" if pack else "ddp2", "train_ddp.py", extra, nproc=2))


def test_fsdp_stopped_resumes_bitwise_on_two_ranks_and_within_the_floor_on_one(streamed, tmp_path,
                                                                                stream_floor):
    """FSDP on 2 ranks stopped at step 10 (its sharded checkpoint holds the sub-streams'
    positions in train_state.pt): resumed on 2 ranks it ends bitwise where the uninterrupted
    run ends; resharded for 1, within the floor (one rank adds its gradients in another order)."""
    reference = streamed("fsdp2", "train_fsdp.py", nproc=2)
    stopped = streamed("fsdp2_stop10", "train_fsdp.py", ["--stop-at-step", "10"], nproc=2)
    two, one = streamed.copy(stopped, tmp_path / "two"), streamed.copy(stopped, tmp_path / "one")
    run_script("train_fsdp.py", args(streamed, two, "--resume"), nproc=2)
    assert_bitwise(two, reference)
    train("train_fsdp.py", args(streamed, one, "--resume"))
    assert_same_training(one, reference, stream_floor)


# ---------------------------------------------------------------------------------------
# Resumed at another world size: the same global batches, within the rounding floor


def test_resumed_from_4_ranks_on_2_then_on_1_trains_the_same_model(streamed, tmp_path, stream_floor):
    """DDP at 4 ranks stopped at step 6 (first epoch), resumed on 2 ranks to step 13 (some
    sub-streams in their second epoch, the others still in their first), then on 1 to the
    end: the uninterrupted 4-rank run's model, within the floor, and the same tokens seen.
    Each rank takes from the checkpoint the sub-streams it owns at the new world size."""
    out = tmp_path / "run"
    run_script("train_ddp.py", args(streamed, out, "--stop-at-step", "6"), nproc=4)
    run_script("train_ddp.py", args(streamed, out, "--resume", "--stop-at-step", "13"), nproc=2)
    assert sorted(set(epochs_at(out, 13))) == [0, 1]
    train("train_ddp.py", args(streamed, out, "--resume"))
    assert_same_training(out, streamed("ddp4", "train_ddp.py", nproc=4), stream_floor)


def test_packed_resumed_from_2_ranks_on_4_trains_the_same_model(streamed, tmp_path, stream_floor):
    """--pack on 2 ranks stopped at step 12 (every sub-stream in its second epoch, its packer
    holding open rows), resumed on 4: each rank given the packers of the sub-streams it owns
    now, the model is the uninterrupted 2-rank run's, within the floor."""
    out = tmp_path / "run"
    at = SECOND_EPOCH_STEP[True]
    run_script("train_ddp.py", args(streamed, out, *PACK, "--stop-at-step", str(at)), nproc=2)
    assert epochs_at(out, at) == [1] * 4
    run_script("train_ddp.py", args(streamed, out, *PACK, "--resume"), nproc=4)
    assert_same_training(out, streamed("ddp2_packed", "train_ddp.py", PACK, nproc=2), stream_floor)
