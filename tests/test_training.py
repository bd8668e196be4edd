"""Whole training runs: one process, DataParallel and DDP train the same model; resume is
exact; only rank 0 writes; the files load as documented."""

import json
import re
from pathlib import Path

import pytest
import torch

import data
from conftest import (FAST, FAST_WITH_TOKENIZER, FLOOR_MULTIPLE, assert_learns, assert_same_model, assert_same_weights,
                      ddp_two_ranks, load_weights, max_weight_diff, metrics, run_in_process, run_script, script_in_process, spied,
                      stopped_at_step_4, train)
from model import IGNORE_INDEX, LlamaForPretraining
from training import build, config, corpus, launch, pt_checkpoint, resume, run_data, tokenized, turns, weights

# DDP at 2 ranks adds gradients up in another order than one process does, so weights agree
# to rounding, not bitwise: within a multiple of the rounding floor measured on this machine
# in this session (conftest.FLOOR_MULTIPLE says how it is measured and why).


def test_ranks_hold_different_numbers_of_pad_tokens(corpus):
    """Guard for the equivalence tests below: with this corpus the two ranks' halves of a
    global batch differ in real tokens, so a per-rank mean loss would train a different model."""
    cfg = config.parse_args(["--dataset", str(corpus), *FAST])
    documents = run_data.Corpus(cfg)
    train_ds = documents.training_rows(documents.train_tokenizer())
    real_tokens = []
    for rank in range(2):
        sampler = data.ResumableDistributedSampler(train_ds, num_replicas=2, rank=rank, seed=cfg.seed, drop_last=True)
        sampler.set_epoch(0)
        first = list(sampler)[: cfg.batch_size // 2]
        real_tokens.append(sum(int((train_ds[i][1] != IGNORE_INDEX).sum()) for i in first))
    assert real_tokens[0] != real_tokens[1]


def test_ddp_on_two_ranks_trains_the_same_model_as_one_process(runs, floor):
    # the weights, and the logged loss: the global token-weighted loss, whatever the world size
    assert_same_model(ddp_two_ranks(runs), runs("dp", "train_dp.py"), floor)


def test_grad_accumulation_trains_the_same_model(runs, floor):
    one = runs("dp", "train_dp.py")
    assert_same_model(runs("dp_accum2", "train_dp.py", ["--grad-accum", "2"]), one, floor)
    assert_same_model(runs("ddp2_accum2", "train_ddp.py", ["--grad-accum", "2"], nproc=2), one, floor)


def test_the_bound_from_the_rounding_floor_catches_a_dropped_micro_batch(runs, floor):
    """One of the bugs the bound was calibrated against (conftest.FLOOR_MULTIPLE): one
    micro-batch of 16 never trains. The bound must see it, by orders of magnitude."""
    dropped = runs("dp_accum2_one_dropped", "train_dp.py", ["--grad-accum", "2"], perturb="drop-micro-batch")
    distance = max_weight_diff(load_weights(dropped), load_weights(runs("dp", "train_dp.py")))
    assert distance > 10 * FLOOR_MULTIPLE * floor.weights
    with pytest.raises(AssertionError):
        assert_same_model(dropped, runs("dp", "train_dp.py"), floor)


def test_dataparallel_script_equals_ddp_script_at_world_size_one(runs):
    assert_same_model(runs("dp", "train_dp.py"), runs("ddp1", "train_ddp.py"))  # bitwise


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
    model, _ = weights.load_trained(out)
    state = torch.load(out / "model.pt", map_location="cpu", weights_only=True)
    assert not [k for k in state if k.startswith(("module.", "_orig_mod."))]
    assert model.state_dict().keys() == state.keys()  # every weight, nothing else
    # the final weights: what the step-8 checkpoint holds, written by another code path
    step8 = torch.load(out / "checkpoint-00000008.pt", map_location="cpu", weights_only=True)["model"]
    assert all(torch.equal(model.state_dict()[k], step8[k]) for k in state)
    assert isinstance(model, LlamaForPretraining) and model.config.vocab_size == 300
    # the checkpoint loads with weights_only and holds everything an exact resume needs
    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "step", "epoch", "step_in_epoch", "rng",
            "model_config", "train_config"} <= ckpt.keys()
    assert ckpt["step"] == 8 and ckpt["train_config"]["batch_size"] == 8
    rows = metrics(out)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8]
    assert all({"step", "epoch", "loss", "lr", "tokens_per_s"} <= r.keys() for r in train_rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # it learns
    assert not [r for r in rows if "mfu" in r]  # no MFU against a peak a CPU does not have
    assert tokenized.load_tokenizer(out / "tokenizer.json").get_vocab_size() == 300


@pytest.mark.parametrize("script", ["train_dp.py", "train_ddp.py", "train_fsdp.py"])
def test_with_device_cpu_on_a_gpu_machine_no_cuda_context_is_opened(runs, tmp_path, monkeypatch, capsys, script):
    """--device cpu where torch sees GPUs: a run, a save and a resume never open a CUDA context
    (0.3-0.5 GiB of GPU 0 in every rank). Faked here: torch says it has a GPU, and anything that
    would open a context fails the run."""
    def no_context():
        raise AssertionError("a CUDA context was opened")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_context)
    out = tmp_path / "run"
    args = ["--dataset", str(runs.corpus), *FAST, "--device", "cpu", "--out-dir", str(out)]
    assert script_in_process(script, [*args, "--stop-at-step", "4"]) == 0, capsys.readouterr().err
    assert script_in_process(script, [*args, "--resume"]) == 0, capsys.readouterr().err
    assert (out / "model.pt").exists()


def test_ddp_compiles_each_layer_and_the_lm_head_apart_so_no_graph_spans_a_bucket_of_layers(runs, tmp_path,
                                                                                              monkeypatch):
    """train_ddp.py --compile: dynamo's DDP optimizer cuts a compiled graph at each gradient
    bucket, so that each bucket's all-reduce can start during backward; a whole-model graph
    became 14 graphs for the `article` model, each compiled apart. Compiled by layer, as
    train_fsdp.py does, one layer's graph serves every layer and no graph holds more than one
    layer's work. Counted with a backend of our own that compiles nothing."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(sum(node.op == "call_function" for node in gm.graph.nodes))
        return gm.forward
    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: real_compile(self, backend=counting))
    torch._dynamo.reset()
    model = build.model(config.parse_args(["--vocab-size", "300"]), 300, torch.float32)
    real_compile(model.base_model.layers[0], backend=counting)  # one layer alone, without DDP
    ids = torch.randint(0, 300, (1, 8))
    model(ids, ids)
    [layer] = graphs
    graphs.clear()
    torch._dynamo.reset()
    out = tmp_path / "run"
    assert script_in_process("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--compile", "--max-steps", "2",
                                              "--out-dir", str(out)]) == 0
    print(f"one layer: {layer} operations; under DDP: graphs of {graphs}")
    assert graphs and max(graphs) <= layer  # (training's and evaluation's: a layer, maybe cut at a bucket; the head)
    torch._dynamo.reset()


def test_resume_is_bitwise_exact_with_the_same_data_under_another_path(runs, tmp_path, monkeypatch):
    """The data is recognized by its content (moved, renamed, given by a relative path)."""
    import shutil
    straight = runs("dp", "train_dp.py")
    half = stopped_at_step_4(runs, tmp_path)
    assert not (half / "model.pt").exists()  # stopped early: a checkpoint, no final weights
    assert torch.load(half / "checkpoint.pt", weights_only=True, map_location="cpu")["step"] == 4
    # a run killed after logging step 6 but before its next checkpoint leaves a stale row
    with open(half / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "epoch": 0, "loss": 99.0, "lr": 0.0, "tokens_per_s": 1.0}) + "\n")
    moved = tmp_path / "elsewhere" / "renamed.txt"
    moved.parent.mkdir()
    shutil.copy(runs.corpus, moved)
    monkeypatch.chdir(tmp_path)
    train("train_dp.py", ["--dataset", "elsewhere/renamed.txt", *FAST, "--out-dir", str(half), "--resume"])
    # bitwise, and metrics.jsonl continues from the checkpoint's step, with the straight run's losses
    assert_same_model(half, straight)


def test_a_ddp_checkpoint_resumes_under_the_dataparallel_script(runs, tmp_path):
    half = stopped_at_step_4(runs, tmp_path, "train_ddp.py")
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume"])
    assert_same_model(half, runs("dp", "train_dp.py"))


def test_a_dataparallel_checkpoint_resumes_under_ddp_on_two_ranks(runs, tmp_path, floor):
    half = stopped_at_step_4(runs, tmp_path)
    run_script("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume"],
               nproc=2)
    assert_same_model(half, runs("dp", "train_dp.py"), floor)  # another world size from step 4 on


def test_a_saved_tokenizer_reproduces_the_run(runs, tmp_path):
    first = runs("dp", "train_dp.py")
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST_WITH_TOKENIZER, "--tokenizer",
                          str(first / "tokenizer.json"), "--out-dir", str(tmp_path / "again")])
    assert_same_weights(tmp_path / "again", first)


def test_resume_across_an_epoch_boundary_is_bitwise_exact(runs, tmp_path):
    """231 training documents, cut into windows, in global batches of 64: fewer than 12 steps
    an epoch. Stopped at step 4 and resumed, the run reshuffles for epoch 1 exactly as a
    straight run does."""
    epochs = ["--batch-size", "64", "--max-steps", "12", "--log-every", "1"]
    straight = runs("dp_two_epochs", "train_dp.py", epochs)
    per_epoch = int(re.search(r"\| (\d+) steps per epoch \| 12 steps \|", runs.output["dp_two_epochs"]).group(1))
    assert 4 < per_epoch < 12
    assert [row["epoch"] for row in metrics(straight) if "loss" in row] == [0] * per_epoch + [1] * (12 - per_epoch)
    half = runs.copy(runs("dp_two_epochs_half", "train_dp.py", [*epochs, "--stop-at-step", "4"]), tmp_path / "half")
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST, *epochs, "--out-dir", str(half), "--resume"])
    assert_same_model(half, straight)


@pytest.mark.parametrize("script, nproc", [("train_dp.py", 0), ("train_ddp.py", 2)])
def test_resume_with_gradient_accumulation_is_bitwise_exact(runs, tmp_path, script, nproc):
    """A resumed run skips the samples its steps trained: each rank's micro-batch of every
    micro-step, --grad-accum of them a step. Stopped at step 4 with --grad-accum 2 and resumed,
    it ends bitwise where the straight run ends (skipping one micro-batch a step would train
    some samples twice and others never, and every loss would still fall)."""
    accum = ["--grad-accum", "2"]
    name = "dp_accum2" if script == "train_dp.py" else "ddp2_accum2"
    straight = runs(name, script, accum, nproc)
    half = runs.copy(runs(f"{name}_stop4", script, [*accum, "--stop-at-step", "4"], nproc), tmp_path / "half")
    printed = train(script, ["--dataset", str(runs.corpus), *FAST, *accum, "--out-dir", str(half), "--resume"], nproc)
    assert f"resumed from {half}/checkpoint.pt at step 4" in printed
    assert_same_model(half, straight)


def test_ddp_all_reduces_gradients_only_on_the_last_micro_step(runs, tmp_path, monkeypatch):
    """no_sync: with --grad-accum 4 each bucket of gradients is all-reduced once per optimizer
    step, not once per micro-step (the weights would be the same either way, so the
    all-reduces are counted: a comm hook on train_ddp.py's DDP, in a world of one)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    reduced = []
    real_init = DistributedDataParallel.__init__

    def init_and_count(self, *args, **kwargs):
        real_init(self, *args, **kwargs)

        def counting_allreduce(state, bucket):
            reduced.append(bucket.buffer().numel())  # DDP regroups its buckets after the first step
            return default_hooks.allreduce_hook(None, bucket)
        self.register_comm_hook(None, counting_allreduce)

    monkeypatch.setattr(DistributedDataParallel, "__init__", init_and_count)
    run_in_process("train_ddp.py", ["--dataset", str(runs.corpus), *FAST, "--grad-accum", "4", "--max-steps", "3",
                                    "--out-dir", str(tmp_path / "run")])
    n_params = sum(p.numel() for p in weights.load_trained(tmp_path / "run")[0].parameters())
    assert sum(reduced) == 3 * n_params  # every gradient once in each of 3 steps, not 4 times


def test_the_learning_rate_warms_up_linearly_then_decays_to_zero_on_a_cosine():
    cfg = config.parse_args(["--lr", "0.002", "--warmup-steps", "10"])
    model = torch.nn.Linear(4, 4)
    optimizer, scheduler = build.optimizer(model, cfg, total_steps=110)
    lrs = []
    for _ in range(111):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.0002)  # warmup starts at 0.1x the peak
    assert lrs[5] == pytest.approx(0.0002 + 0.5 * 0.0018)  # linear
    assert lrs[10] == pytest.approx(0.002) and max(lrs) == lrs[10]  # the peak, once
    assert lrs[60] == pytest.approx(0.001)  # half way down the cosine: half the peak
    assert lrs[110] == pytest.approx(0.0, abs=1e-12)  # zero at the last step
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # never rises again


def test_weight_decay_applies_to_matrices_and_embeddings_not_to_norm_gains(corpus):
    cfg = config.parse_args(["--dataset", str(corpus), *FAST, "--weight-decay", "0.1"])
    model = build.model(cfg, vocab_size=300, dtype=torch.float32)
    optimizer, _ = build.optimizer(model, cfg, total_steps=8)
    group_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    decays = {name: group_of[id(p)] for name, p in model.named_parameters()}
    assert len(decays) == len(list(model.parameters()))  # every parameter in exactly one group
    assert decays["base_model.embed_tokens.weight"] == decays["lm_head.weight"] == 0.1
    assert decays["base_model.layers.0.self_attn.q_proj.weight"] == decays["base_model.layers.1.mlp.down_proj.weight"] == 0.1
    norms = [name for name in decays if "norm" in name]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1 and all(decays[name] == 0.0 for name in norms)


def test_gradient_clipping_clips_the_global_norm(corpus, tmp_path, monkeypatch):
    """train_dp.py in this process: the norm of the gradients the optimizer steps with never
    exceeds --grad-clip, though it would without clipping; --grad-clip 0 turns it off (the norm
    is still computed, for the log)."""
    def grad_norms(clip):
        before, after = [], []
        real_clip, real_step = torch.nn.utils.clip_grad_norm_, build.AdamW.step

        def clip_and_record(params, max_norm, *args, **kwargs):
            norm = real_clip(list(params), max_norm, *args, **kwargs)  # returns the norm before clipping
            before.append(norm.item())
            return norm

        def step_and_record(self, *args, **kwargs):
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            after.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
            return real_step(self, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(torch.nn.utils, "clip_grad_norm_", clip_and_record)
            m.setattr(build.AdamW, "step", step_and_record)
            run_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--grad-clip", str(clip),
                                           "--out-dir", str(tmp_path / f"clip{clip}")])
        return before, after

    before, after = grad_norms(0.1)
    assert len(before) == len(after) == 8 and max(before) > 0.1  # clipping had work to do
    assert all(norm <= 0.1 * (1 + 1e-4) for norm in after)
    before, after = grad_norms(0)
    assert max(after) > 0.1 and after == pytest.approx(before, rel=1e-4)  # off: the norms reach the optimizer


@pytest.mark.compile
def test_compile_under_ddp_on_two_ranks_trains_the_same_model(runs, floor):
    """Each rank compiles its model before DDP wraps it (DDP then splits the graph at its
    buckets): graphs are built on both ranks, the model is the eager one to rounding, and
    model.pt holds plain fp32 weights."""
    compiled, spy = spied(runs, "ddp2_compiled", "train_ddp.py", ["--compile"], nproc=2)
    assert len(spy) == 2 and all(rank["compiled_graphs"] > 0 for rank in spy)  # the flag took effect
    assert_same_model(compiled, ddp_two_ranks(runs), floor)
    state = load_weights(compiled)
    assert all(w.dtype == torch.float32 for w in state.values())
    model, _ = weights.load_trained(compiled)  # plain keys: loads strictly into a plain model
    last = torch.load(compiled / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]  # step 8's
    assert all(torch.equal(model.state_dict()[k], last[k]) for k in state)


def test_the_start_up_line_and_the_first_metrics_row_count_every_token_of_the_training_documents(runs):
    """Counted again here from the run's own tokenizer: every training document's tokens and
    its [EOT] are targets, in ceil(targets / 32) windows of 32 predictions each."""
    out = runs("dp", "train_dp.py")
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST])
    train_text, _, _ = run_data.load_text(cfg)
    tokenizer = data.text_only(tokenized.load_tokenizer(out / "tokenizer.json"))
    targets = [len(e.ids) + 1 for e in tokenizer.encode_batch(train_text["text"], add_special_tokens=False)]
    windows, tokens = sum(-(-n // 32) for n in targets), sum(targets)
    assert windows > len(train_text) + 50  # many documents span several windows (what the resume tests cross)
    padding = 1 - tokens / (windows * 32)
    assert (f"| {len(train_text)} documents: all their {tokens:,} tokens an epoch, in {windows:,} windows of 32 "
            f"({padding:.1%} padding) |") in runs.output["dp"]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first == {"step": 0, "documents": len(train_text), "windows": windows, "rows": windows,
                     "tokens_per_epoch": tokens, "padding": pytest.approx(padding)}


def test_bits_per_byte_is_the_held_out_loss_over_the_bytes_of_the_held_out_text(runs):
    """Computed directly: the final weights, every held-out document encoded whole and cut into
    windows (test_data's reference), the summed cross-entropy of all their targets in bits, over
    the UTF-8 bytes of those documents. The run logged it at its last evaluation (step 8)."""
    import math

    import torch.nn.functional as F
    from test_data import windows_of_whole_documents
    out = runs("dp", "train_dp.py")
    logged = [row for row in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
              if "val_bpb" in row]
    assert len(logged) == 2  # --eval-every 4 of 8 steps: every evaluation logs it
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST])
    _, val_text, _ = run_data.load_text(cfg)
    model, tokenizer = weights.load_trained(out)
    nats = 0.0
    with torch.no_grad():
        for window in windows_of_whole_documents(val_text["text"], tokenizer, 32):
            ids = torch.tensor([window])
            nats += F.cross_entropy(model(ids[:, :-1])[0].double(), ids[0, 1:], reduction="sum").item()
    text_bytes = sum(len(t.encode()) for t in val_text["text"])
    assert logged[-1]["val_bpb"] == pytest.approx(nats / math.log(2) / text_bytes, rel=1e-5)


def test_rank_0_alone_hashes_the_corpus_and_every_rank_gets_its_fingerprint(runs, monkeypatch):
    """Hashing the corpus takes about 3 s a GB: once per job, on rank 0, not once per rank.
    Here as rank 1 sees it: the fingerprint comes from rank 0 (InTurns.from_rank0)."""
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST])
    from_rank0 = corpus.fingerprint(corpus.load_corpus(str(runs.corpus)))

    class Rank1(turns.OneProcess):
        def from_rank0(self, fn):
            return from_rank0

    monkeypatch.setattr(corpus, "fingerprint", lambda documents: pytest.fail("a rank other than 0 hashed the corpus"))
    train_text, val_text, fingerprint = run_data.load_text(cfg, None, Rank1())
    assert fingerprint == from_rank0 and len(train_text) + len(val_text) == from_rank0["documents"]


def test_local_rank_0_loads_and_tokenizes_the_corpus_first_and_the_other_ranks_read_its_cache(runs, tmp_path,
                                                                                              monkeypatch):
    """Loading and tokenizing the corpus write `datasets`' cache: each node's local rank 0 does
    both in a turn of its own (InTurns.local_rank0_first), then the other ranks read what it
    cached. Run everywhere at once, every rank would tokenize the whole corpus, racing to write
    the same files, into the same datasets: no loss tells. The turn each stage of prepare() ran
    in is recorded here."""
    class Recorded(turns.OneProcess):
        turn = "everywhere"

        def local_rank0_first(self, fn):
            self.turn = "local rank 0 first"
            try:
                return fn()
            finally:
                self.turn = "everywhere"

    recorded, stages = Recorded(), []
    real_load, real_make = corpus.load_corpus, run_data.make_dataset
    monkeypatch.setattr(corpus, "load_corpus", lambda *a: stages.append(("load", recorded.turn)) or real_load(*a))
    monkeypatch.setattr(run_data, "make_dataset",
                        lambda *a, **k: stages.append(("tokenize", recorded.turn)) or real_make(*a, **k))
    monkeypatch.setattr(run_data, "claim_out_dir", lambda cfg, ckpt: None)  # no lock left on the folder
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST, "--out-dir", str(tmp_path / "run")])
    run_data.prepare(cfg, recorded)
    assert stages == [("load", "local rank 0 first"), *[("tokenize", "local rank 0 first")] * 2]  # training, held out


def test_fp32_matmuls_on_cuda_use_tf32_and_on_a_cpu_stay_full_fp32():
    """--dtype fp32 means fp32 weights and optimizer state; on CUDA its matmuls run on TF32
    tensor cores (several times faster). No GPU is touched to decide it."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert launch.compute_dtype("fp32", torch.device("cpu")) == torch.float32
        assert torch.get_float32_matmul_precision() == "highest"
        assert launch.compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_resumed_rank_keeps_no_copy_of_the_checkpoint_and_lets_its_file_go(runs, tmp_path):
    """The checkpoint is memory-mapped, not read into each rank's memory; once restored, the
    loaded state is dropped and the optimizer holds copies of its own, so the file is no
    longer mapped: a pruned checkpoint's disk space is freed, and no rank carries a second
    copy of the weights and optimizer state through the run."""
    import gc
    out = runs.copy(runs("dp", "train_dp.py"), tmp_path / "run")
    cfg = config.parse_args(["--dataset", str(runs.corpus), *FAST, "--out-dir", str(out), "--resume"])
    ckpt = pt_checkpoint.load_latest_checkpoint(out)
    path = str(Path(ckpt["path"]).resolve())
    assert path in Path("/proc/self/maps").read_text()  # mapped, not read

    model = build.model(cfg, ckpt["model_config"]["vocab_size"], torch.float32)
    optimizer, scheduler = build.optimizer(model, cfg, total_steps=8)
    assert resume.from_checkpoint(ckpt, cfg, model, optimizer, scheduler, ckpt["steps_per_epoch"]) == 8
    assert ckpt == {}
    gc.collect()
    assert path not in Path("/proc/self/maps").read_text()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in torch.load(
        path, map_location="cpu", weights_only=True)["model"].items())  # and restored all the same


# ---- warm starts: --init-from -------------------------------------------------------------

WARM = FAST_WITH_TOKENIZER  # --init-from brings its own tokenizer


def warm_started(runs, *extra):
    """The one-process run from the reference run's weights (--init-from; its --vocab-size is
    the weights' own), trained once for every test that compares with it."""
    source = runs("dp", "train_dp.py")
    return runs(f"dp_warm{''.join(extra)}", "train_dp.py", ["--init-from", str(source), *extra])


def test_init_from_starts_a_new_run_at_the_trained_weights_with_a_fresh_schedule(runs, tmp_path):
    """A finished 8-step run continued for 8 more: the new run starts from its weights (bitwise)
    and its tokenizer, so its first logged loss is near where that run ended, not where it
    began; the optimizer, the LR schedule and the data position start afresh."""
    first, warm = runs("dp", "train_dp.py"), warm_started(runs)
    cfg = config.parse_args(["--dataset", str(runs.corpus), *WARM, "--init-from", str(first)])
    start = build.model(cfg, 300, torch.float32).state_dict()
    assert all(torch.equal(start[k], v) for k, v in load_weights(first).items())
    before, after = ([row for row in metrics(run) if "loss" in row] for run in (first, warm))
    assert_learns(before)
    learned = before[0]["loss"] - before[-1]["loss"]
    assert abs(after[0]["loss"] - before[-1]["loss"]) < learned / 4
    assert [row["lr"] for row in after] == [row["lr"] for row in before]  # the schedule from its start
    assert (warm / "tokenizer.json").read_text() == (first / "tokenizer.json").read_text()


def test_init_from_works_under_ddp_and_fsdp_and_from_a_sharded_checkpoint(runs, tmp_path, floor):
    """DDP and FSDP on 2 ranks, warm-started from a one-process run's folder, train the model
    one process trains from it (to rounding). A train_fsdp.py checkpoint folder gives the
    weights gathered from its shards: bitwise those of that run's model.pt at the same step."""
    from test_fsdp import fsdp_two_ranks
    first = runs("dp", "train_dp.py")
    common = ["--dataset", str(runs.corpus), *WARM, "--init-from", str(first)]
    trained = {"train_dp.py": warm_started(runs)}
    for script, nproc in (("train_ddp.py", 2), ("train_fsdp.py", 2)):
        trained[script] = tmp_path / script
        train(script, [*common, "--out-dir", str(trained[script])], nproc)
    for script in ("train_ddp.py", "train_fsdp.py"):
        assert_same_model(trained[script], trained["train_dp.py"], floor)
    sharded = fsdp_two_ranks(runs)
    at_step_8 = sharded / "checkpoint-00000008"
    cfg = config.parse_args(["--dataset", str(runs.corpus), *WARM, "--init-from", str(at_step_8)])
    start = build.model(cfg, 300, torch.float32).state_dict()
    assert all(torch.equal(start[k], v) for k, v in load_weights(sharded).items())
