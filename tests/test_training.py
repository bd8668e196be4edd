"""Whole training runs: one process, DataParallel and DDP train the same model; resume is
exact; only rank 0 writes; the files load as documented."""

import json

import pytest
import torch

import data
import checkpointing
import training
from conftest import FAST, FAST_WITH_TOKENIZER, ddp_two_ranks, load_weights, max_weight_diff, metrics, run_script, without_speed
from model import IGNORE_INDEX, LlamaForPretraining

# DDP at 2 ranks sums gradients in a different order than one process, so weights agree to
# rounding, not bitwise. (AdamW's eps=1e-8 amplifies rounding on near-zero gradients.)
DDP_TOLERANCE = 1e-5


def test_ranks_hold_different_numbers_of_pad_tokens(corpus):
    """Guard for the equivalence tests below: with this corpus the two ranks' halves of a
    global batch differ in real tokens, so a per-rank mean loss would train a different model."""
    cfg = training.parse_args(["--dataset", str(corpus), *FAST])
    train_text, val_text = training.load_text(cfg)
    tokenizer = data.train_tokenizer(train_text, cfg.vocab_size)
    train_ds, _ = training.make_datasets(cfg, tokenizer, train_text, val_text)
    real_tokens = []
    for rank in range(2):
        sampler = data.ResumableDistributedSampler(train_ds, num_replicas=2, rank=rank, seed=cfg.seed, drop_last=True)
        sampler.set_epoch(0)
        first = list(sampler)[: cfg.batch_size // 2]
        real_tokens.append(sum(int((train_ds[i][1] != IGNORE_INDEX).sum()) for i in first))
    assert real_tokens[0] != real_tokens[1]


def test_ddp_on_two_ranks_trains_the_same_model_as_one_process(runs):
    one = runs("dp", "train_dp.py")
    two = ddp_two_ranks(runs)
    assert max_weight_diff(load_weights(one), load_weights(two)) < DDP_TOLERANCE
    # the logged loss is the global token-weighted loss, whatever the world size
    for a, b in zip(metrics(one), metrics(two), strict=True):
        assert a.keys() == b.keys() and a["step"] == b["step"]
        for key in ("loss", "val_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5)


def test_grad_accumulation_trains_the_same_model(runs):
    one = runs("dp", "train_dp.py")
    accum = runs("dp_accum2", "train_dp.py", ["--grad-accum", "2"])
    assert max_weight_diff(load_weights(one), load_weights(accum)) < DDP_TOLERANCE
    ddp_accum = runs("ddp2_accum2", "train_ddp.py", ["--grad-accum", "2"], nproc=2)
    assert max_weight_diff(load_weights(one), load_weights(ddp_accum)) < DDP_TOLERANCE


def test_dataparallel_script_equals_ddp_script_at_world_size_one(runs):
    dp, ddp = runs("dp", "train_dp.py"), runs("ddp1", "train_ddp.py")
    assert max_weight_diff(load_weights(dp), load_weights(ddp)) == 0.0  # bitwise
    assert without_speed(metrics(dp)) == without_speed(metrics(ddp))


def test_only_rank_0_writes_files(runs):
    out = ddp_two_ranks(runs)
    rank0 = (runs.root / "rank0.txt").read_text().splitlines()
    rank1 = (runs.root / "rank1.txt").read_text().splitlines()
    assert rank1 == []
    for name in ("checkpoint.pt", "model.pt", "metrics.jsonl", "tokenizer.json", "config.json"):
        assert any(line.endswith(f"{out}/{name}") for line in rank0), name
    # A checkpoint is written to a temp file, renamed to its numbered name, and becomes
    # checkpoint.pt through a hard link renamed into place: never written in place.
    step8 = f"{out}/checkpoint-00000008.pt"
    sequence = [f"open {step8}.tmp", f"os.rename {step8}.tmp -> {step8}",
                f"os.link {step8} -> {out}/checkpoint.pt.tmp",
                f"os.rename {out}/checkpoint.pt.tmp -> {out}/checkpoint.pt"]
    start = rank0.index(sequence[0])
    positions = [rank0.index(event, start) for event in sequence]
    assert positions == sorted(positions)
    assert f"open {out}/checkpoint.pt" not in rank0
    assert sorted(p.name for p in out.glob("checkpoint*")) == [
        "checkpoint-00000004.pt", "checkpoint-00000008.pt", "checkpoint.pt"]  # --keep-checkpoints 2


def test_output_folder_holds_what_the_readme_promises(runs):
    out = runs("dp", "train_dp.py")
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-00000004.pt", "checkpoint-00000008.pt", "checkpoint.pt", "config.json",
        "metrics.jsonl", "model.pt", "tokenizer.json"]
    assert (out / "checkpoint.pt").samefile(out / "checkpoint-00000008.pt")  # one file, two names
    # model.pt is a plain state_dict that loads strictly into a fresh model
    model, _ = checkpointing.load_trained(out)
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert not [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert model.load_state_dict(state, strict=True) is not None
    assert isinstance(model, LlamaForPretraining) and model.config.vocab_size == 300
    # the checkpoint loads with weights_only and holds everything an exact resume needs
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch", "rng",
            "model_config", "train_config"} <= ckpt.keys()
    assert ckpt["step"] == 8 and ckpt["train_config"]["batch_size"] == 8
    for key in state:
        assert torch.equal(ckpt["model"][key], state[key])
    rows = metrics(out)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8]
    assert all({"step", "epoch", "loss", "lr", "tokens_per_s"} <= r.keys() for r in train_rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # it learns
    assert data.load_tokenizer(out / "tokenizer.json").get_vocab_size() == 300


def test_resume_is_bitwise_exact(runs):
    straight = runs("dp", "train_dp.py")
    half = runs("dp_half", "train_dp.py", ["--stop-at-step", "4"])
    assert not (half / "model.pt").exists()  # stopped early: a checkpoint, no final weights
    assert torch.load(half / "checkpoint.pt", weights_only=True, map_location="cpu")["step"] == 4
    # a run killed after logging step 6 but before its next checkpoint leaves a stale row
    with open(half / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "epoch": 0, "loss": 99.0, "lr": 0.0, "tokens_per_s": 1.0}) + "\n")
    run_script("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume"])
    assert max_weight_diff(load_weights(straight), load_weights(half)) == 0.0
    # metrics.jsonl continues from the checkpoint's step, with the same losses as the straight run
    assert without_speed(metrics(half)) == without_speed(metrics(straight))


def test_a_ddp_checkpoint_resumes_under_the_dataparallel_script(runs):
    straight = runs("dp", "train_dp.py")
    half = runs("ddp1_half", "train_ddp.py", ["--stop-at-step", "4"])
    run_script("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume"])
    assert max_weight_diff(load_weights(straight), load_weights(half)) == 0.0


def test_a_dataparallel_checkpoint_resumes_under_ddp_on_two_ranks(runs):
    straight = runs("dp", "train_dp.py")
    half = runs("dp_half_for_ddp", "train_dp.py", ["--stop-at-step", "4"])
    run_script("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume"],
               nproc=2)
    assert max_weight_diff(load_weights(straight), load_weights(half)) < DDP_TOLERANCE


def test_a_saved_tokenizer_reproduces_the_run(runs, tmp_path):
    first = runs("dp", "train_dp.py")
    run_script("train_dp.py", ["--dataset", str(runs.corpus), *FAST_WITH_TOKENIZER, "--tokenizer", str(first / "tokenizer.json"),
                               "--out-dir", str(tmp_path / "again")])
    assert max_weight_diff(load_weights(first), load_weights(tmp_path / "again")) == 0.0
