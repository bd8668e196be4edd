"""A run that cannot fit in memory is refused with one line, and one that may not fit is
warned about, once the vocabulary is known: before the corpus is tokenized, and before
anything is written (memory.py). The estimate behind both is checked against what a
training step really holds."""

import dataclasses
import os

import pytest
import torch

from conftest import FAST, run_script, train
from model import PRESETS, LlamaConfig, LlamaForPretraining
from test_bad_inputs import refused_in_process
from training import build, checkpoint, config, memory, pt_checkpoint, run_data, stopping
from training.errors import UsageError


def saved_for_backward(model, x, y, position_ids=None) -> int:
    """Bytes of the tensors autograd saves in one forward, the weights themselves left out."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y, position_ids)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in weights)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_estimate_bounds_what_autograd_saves_per_token(dtype, checkpointing):
    """Measured at two batch sizes: the difference is what each token adds, and what stays is
    autocast's bf16 copy of every matmul weight (and RoPE's tables). The estimate per token is
    at least what is saved, and at most 1.5 times it; with activation checkpointing it adds
    the one layer that backward makes again at a time, which autograd does not save. A large
    vocabulary adds nothing a token: the chunked LM head keeps no logits."""
    config = LlamaConfig(vocab_size=16384, **PRESETS["tiny"])
    torch.manual_seed(0)
    model = LlamaForPretraining(config)
    model.compute_dtype = dtype
    if checkpointing:
        model.enable_activation_checkpointing()
    T, saved = 64, {}
    for B in (2, 4):
        x = torch.randint(0, config.vocab_size, (B, T))
        saved[B] = saved_for_backward(model, x, x)
    per_token = (saved[4] - saved[2]) / (2 * T)
    estimated = memory.activation_bytes_per_token(config, dtype, checkpointing)
    one_layer = memory.activation_bytes_per_token(config, dtype) - memory.activation_bytes_per_token(
        LlamaConfig(vocab_size=16384, **{**PRESETS["tiny"], "num_hidden_layers": 3}), dtype)
    recomputed = one_layer if checkpointing else 0
    assert per_token <= estimated - recomputed <= 1.5 * per_token, (per_token, estimated)

    # what stays: the weights' bf16 copies, RoPE's tables, the LM head's gradient (made in
    # forward by the chunked loss: counted with the gradients, in the state) and a few scalars
    fixed = saved[2] - 2 * T * per_token
    rope_tables = sum(b.numel() * b.element_size() for b in model.buffers())
    head_gradient = model.lm_head.weight.numel() * 4
    copies = memory.estimate(config, 2, T, dtype, checkpointing=checkpointing).copies
    if checkpointing:  # none kept from forward: the estimate's are the recomputed layer's, in backward
        assert fixed - rope_tables - head_gradient == pytest.approx(0, abs=256)
    else:
        assert copies == pytest.approx(fixed - rope_tables - head_gradient, abs=256), (copies, fixed)


def test_the_state_estimate_is_what_weights_gradients_adamw_and_a_save_hold_after_a_step():
    cfg = config.parse_args(["--vocab-size", "300"])
    model = build.model(cfg, 300, torch.float32)
    optimizer, scheduler = build.optimizer(model, cfg, total_steps=10)
    x = torch.randint(0, 300, (2, 16))
    (model(x, x)[0].sum()).backward()
    optimizer.step()
    need = memory.estimate(model.config, 2, 16, torch.float32)
    held = [*model.parameters(), *(p.grad for p in model.parameters()),
            *(t for state in optimizer.state.values() for t in state.values() if t.dim() > 0)]  # not `step`
    assert need.state == sum(t.numel() * t.element_size() for t in held)
    dataset = type("Dataset", (), {"__len__": lambda self: 80, "corpus": None, "packing_fingerprint": None})()
    run_state = checkpoint.run_state(model, scheduler, cfg, 1, dataset, stopping.Divergence(cfg, 300))
    snapshot = pt_checkpoint.snapshot(model, optimizer, run_state)
    tensors = [*snapshot["model"].values(), *(t for state in snapshot["optimizer"]["state"].values()
                                              for t in state.values() if t.dim() > 0)]
    assert need.snapshot == sum(t.numel() * t.element_size() for t in tensors)


def test_fsdp_holds_a_share_of_the_state_and_one_whole_weight_as_it_draws_them():
    """train_fsdp.py builds on the meta device and draws each whole weight in turn, every rank
    keeping its part (tests/fsdp_initial_weights.py): beyond its share, a rank holds the
    largest weight, whole, for a moment; never the whole model."""
    config = LlamaConfig(vocab_size=300, **PRESETS["tiny"])
    one, eight = (memory.estimate(config, 8, 32, torch.float32, shards=n) for n in (1, 8))
    assert (eight.state, eight.snapshot) == (one.state // 8, one.snapshot // 8)
    assert eight.activations == one.activations  # the micro-batch's, whatever holds the weights
    largest = max(p.numel() for p in LlamaForPretraining(config).parameters())
    assert one.build == 0 and eight.build == 4 * largest
    assert eight.fixed == eight.state + eight.snapshot  # 28 / 8 bytes a parameter: the share, not the model


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_fsdp_run_whose_shares_fit_is_not_refused_for_a_whole_model_it_never_builds(monkeypatch, device):
    """Memory for a share of 8 (28 / 8 bytes a parameter; on a GPU, the host's 12 / 8 for each
    save's copy) but not for the whole fp32 model (4 bytes a parameter): FSDP trains; DDP,
    which holds every weight, is refused."""
    cfg = config.parse_args(["--model", "tiny", "--seq-len", "32"])
    parameters = memory.estimate(LlamaConfig(vocab_size=300, **PRESETS["tiny"]), 8, 32, torch.float32).parameters
    room = 15 * parameters // 4  # bytes: under the 4 the whole model would take, over the shares' 3.5
    monkeypatch.setattr(memory, "device_memory", lambda d: (room, room) if d.type == "cpu" else (10**15, 10**15))
    memory.Check(cfg, 8, torch.float32, torch.device(device), shards=8)(300)
    with pytest.raises(UsageError, match="the model cannot fit"):
        memory.Check(cfg, 8, torch.float32, torch.device(device), shards=1)(300)


def test_this_machine_has_memory_and_each_rank_here_gets_its_share(monkeypatch):
    total, available = memory.device_memory(torch.device("cpu"))
    assert 0 < available <= total <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a stray variable, outside torchrun: not ranks
    assert memory.device_memory(torch.device("cpu"))[0] == total
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun started 2 ranks on this machine
    assert memory.device_memory(torch.device("cpu"))[0] == total // 2


@pytest.fixture
def device_with(monkeypatch):
    """device_with(total=..., available=...): the device's memory, each a function of the
    estimate the check makes (its vocabulary is the trained tokenizer's). stop_at_tokenizing:
    tokenizing the corpus ends the run with a line of its own, as the check has let it through."""
    def set_memory(total, available, stop_at_tokenizing=True):
        seen = []
        real_estimate = memory.estimate
        monkeypatch.setattr(memory, "estimate", lambda *a, **k: seen.append(real_estimate(*a, **k)) or seen[-1])
        monkeypatch.setattr(memory, "device_memory", lambda device: (total(seen[-1]), available(seen[-1])))
        if stop_at_tokenizing:
            def not_yet(*args, **kwargs):
                raise UsageError("the corpus would be tokenized now")
            monkeypatch.setattr(run_data, "make_dataset", not_yet)
    return set_memory


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_the_activation_estimate_bounds_what_the_compiled_step_saves_per_token(dtype):
    """--compile as the scripts do it (each layer and the LM head apart): inductor fuses each
    layer's elementwise work and keeps less than eager autograd; the LM head's plain
    formulation keeps the logits. The estimate for compiled runs is at least what the
    compiled graphs save a token (their saved tensors pass the same hooks), at most 1.5x."""
    config = LlamaConfig(vocab_size=16384, **PRESETS["tiny"])
    torch.manual_seed(0)
    model = LlamaForPretraining(config)
    model.compute_dtype = dtype
    for block in [*model.base_model.layers, model.lm_head]:
        block.compile()
    T, saved = 64, {}
    for B in (2, 4):
        x = torch.randint(0, config.vocab_size, (B, T))
        saved_for_backward(model, x, x)  # compiles, for this shape
        saved[B] = saved_for_backward(model, x, x)
    per_token = (saved[4] - saved[2]) / (2 * T)
    estimated = memory.activation_bytes_per_token(config, dtype, compiled=True)
    print(f"compiled {dtype}: {per_token:,.0f} bytes a token saved, {estimated:,} estimated")
    assert per_token <= estimated <= 1.5 * per_token, (per_token, estimated)


@pytest.mark.parametrize("script", ["train_dp.py", "train_ddp.py", "train_fsdp.py"])
def test_a_model_whose_state_cannot_fit_is_refused_before_tokenizing_or_writing(script, tmp_path, corpus, capsys,
                                                                               device_with):
    """The issue's case: a 2-million-token tokenizer made `tiny` a 1-billion-parameter model,
    which the kernel killed after minutes, leaving files behind."""
    device_with(total=lambda need: need.fixed - 1, available=lambda need: need.fixed - 1)
    refused_in_process(script, ["--dataset", str(corpus), *FAST], tmp_path / "out", "the model cannot fit: its",
                       capsys)
    assert not (tmp_path / "out").exists()

    device_with(total=lambda need: need.fixed, available=lambda need: need.total)  # just fits: no word about it
    refused_in_process(script, ["--dataset", str(corpus), *FAST], tmp_path / "out",
                       "the corpus would be tokenized now", capsys)


def test_a_run_that_may_not_fit_is_warned_about_once_and_trains(tmp_path, corpus, capsys, device_with):
    """The issue's other case: --seq-len 1024 --batch-size 2048 on `tiny` was killed after
    minutes with nothing said. Activations are the rough part of the estimate, so the run goes
    on: the user may know better."""
    device_with(total=lambda need: need.fixed, available=lambda need: need.total - 1, stop_at_tokenizing=False)
    train("train_dp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(tmp_path / "out")])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: this run may not fit in memory: it needs about ")
    assert "of activations for 8 x 32 tokens a micro-step" in warnings[0]
    assert (tmp_path / "out" / "model.pt").exists()


def test_under_torchrun_one_rank_short_of_memory_ends_every_rank_with_one_line(tmp_path, corpus):
    """FSDP on 2 ranks; only rank 1's device is too small (1 MB). Both ranks exit 2 in the same
    turn of data preparation, rank 0 prints the line, and no folder is made."""
    from test_failures import exit_codes, fault_env
    out = tmp_path / "out"
    proc = run_script("train_fsdp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(out)], nproc=2,
                      check=False, timeout=120, wrapper="tests/inject_fault.py",
                      env={**fault_env(tmp_path, "small-memory", step=0, rank=1), "FAULT_BYTES": "1000000"})
    assert exit_codes(tmp_path) == {"exit-rank0": "2", "exit-rank1": "2"}
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: the model cannot fit: its ")
    assert "this process has 1.0 MB of CPU memory" in errors[0]
    assert not out.exists()


@pytest.mark.parametrize("version", [2, 1])
def test_the_limit_of_a_nested_cgroup_counts_with_what_it_already_uses(tmp_path, version):
    """A Slurm job's or a container's limit sits on its own group, below the root: every group
    from the process's own up to the root counts, and what a group already uses is not free."""
    if version == 2:
        own, root, files = "0::/slurm/job_7/step_0\n", tmp_path, ("memory.max", "memory.current")
    else:
        own, root, files = "4:memory:/slurm/job_7/step_0\n5:cpu,cpuacct:/x\n", tmp_path / "memory", (
            "memory.limit_in_bytes", "memory.usage_in_bytes")
    (tmp_path / "cgroup").write_text(own)
    for group, limit, used in [("", "max", "1"), ("slurm", "max", "1"), ("slurm/job_7", "4000000000", "1000000000")]:
        (root / group).mkdir(parents=True, exist_ok=True)
        (root / group / files[0]).write_text(limit)
        (root / group / files[1]).write_text(used)
    assert list(memory.cgroup_limits(tmp_path / "cgroup", tmp_path)) == [(4_000_000_000, 1_000_000_000)]


def test_on_a_gpu_the_host_memory_the_model_passes_through_is_checked_too(monkeypatch):
    """The fp32 model is built in CPU memory before it moves to the GPU, and each save copies
    its state back there: a model the GPU can hold but the host cannot is refused as well."""
    cfg = config.parse_args(["--model", "tiny", "--seq-len", "32"])
    monkeypatch.setattr(memory, "device_memory",
                        lambda device: (10**15, 10**15) if device.type == "cuda" else (10**6, 10**6))
    check = memory.Check(cfg, 8, torch.bfloat16, torch.device("cuda", 0))
    with pytest.raises(UsageError, match="of CPU memory per process .* and this process has 1.0 MB"):
        check(300)
    monkeypatch.setattr(memory, "device_memory", lambda device: (10**15, 10**15))
    check(300)  # a host large enough: nothing said


TP_CONFIG = LlamaConfig(vocab_size=8192, **PRESETS["tiny"])  # a model TP splits in 2, whose vocabulary counts


def _tp_worker(rank, store_path, results):
    """On 2 gloo ranks, the model as train_tp.py builds it at (dp 1, tp 2), in fp32 and bf16:
    what a rank holds from forward into backward at two micro-batches, the loss's peak alone
    at two vocabularies, and each rank's share of the parameters and of FSDP's groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from test_chunked_loss import allocations
    from train_fsdp import shard
    from model import LlamaLMHead
    from training import tensor_parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        cfg = config.parse_args(["--model", "tiny", "--tp", "2"], distributed=True, tensor=True)
        got, T = {}, 64
        for dtype in (torch.float32, torch.bfloat16):
            with torch.device("meta"):
                model = LlamaForPretraining(TP_CONFIG)
            tensor_parallel.parallelize(model, mesh["tp"])
            if dtype == torch.float32:  # the shares, before FSDP (over a "dp" of 1) wraps them
                def share(module):
                    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
                base = model.base_model
                got["parameters"] = share(model)
                got["largest_group"] = max(share(g) for g in [base.embed_tokens, model.lm_head, *base.layers])
            shard(model, mesh["dp"], dtype)
            model.to_empty(device="cpu")
            build.init_weights(model, cfg)
            held, g = {}, torch.Generator().manual_seed(0)
            for B in (2, 4):
                x, y = torch.randint(3, TP_CONFIG.vocab_size, (2, B, T), generator=g)
                model(x, y)[0].sum().backward()  # FSDP's and the allocator's first requests
                kept = []
                held[B] = allocations(lambda: kept.append(model(x, y)[0].sum()))[1]
                kept[0].backward()
            got["held", dtype] = (held[4] - held[2]) / (2 * T)
        N, C = 1024, 64  # the loss alone: tokens, and a hidden size that keeps the head's input small
        peak = {}
        for V in (8192, 16384):
            head = LlamaLMHead(C, V)
            head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), mesh["tp"], [Shard(0)]))
            h = distribute_tensor(torch.randn(1, N, C), mesh["tp"], [Shard(1)]).requires_grad_()
            y = torch.randint(0, V, (1, N))
            peak[V] = allocated_peak_of_loss(lambda: tensor_parallel.vocabulary_parallel_loss(head, h, y), allocations)
        got["loss_per_entry"] = (peak[16384] - peak[8192]) / (16384 - 8192)
        results.put((rank, got))
    except BaseException as e:  # reported, so that the test fails instead of waiting for a result
        results.put((rank, repr(e)))
    results.close()
    results.join_thread()  # the result is in the pipe before os._exit, which would drop it
    os._exit(0)  # (no teardown of gloo: see test_speed.py's DDP worker)


def allocated_peak_of_loss(loss, allocations) -> int:
    """The most a loss holds at once, forward and backward: what its forward keeps, and the peak
    of its backward above that."""
    kept = []
    forward_peak, held = allocations(lambda: kept.append(loss()))
    return max(forward_peak, held + allocations(lambda: kept[0].backward())[0])


@pytest.fixture(scope="module")
def tp_measured(tmp_path_factory):
    import time
    import torch.multiprocessing as mp
    results = mp.get_context("spawn").Queue()
    workers = mp.start_processes(_tp_worker, args=(str(tmp_path_factory.mktemp("tp") / "store"), results),
                                 nprocs=2, join=False, start_method="spawn")
    got = dict(results.get(timeout=600) for _ in range(2))
    deadline = time.monotonic() + 60
    while not workers.join(timeout=1):  # True once both exited; raises if one failed
        assert time.monotonic() < deadline, "a worker did not exit"
    for measured in got.values():
        assert isinstance(measured, dict), measured  # the worker's error
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_under_tp_the_activation_estimate_bounds_what_a_rank_holds_from_forward_into_backward(tp_measured, dtype):
    """train_tp.py's model at (dp 1, tp 2), its allocations recorded by torch.profiler at two
    micro-batches: what each token adds to what a rank holds once forward is done (the
    activations, and the chunked loss's gradient of the hidden states) is at most the estimate,
    and the estimate at most 1.5x it. Not divided by tp (the sequence-parallel norms, this rank's
    heads and hidden units), the estimate would be 1.9x what is held."""
    estimated = memory.activation_bytes_per_token(TP_CONFIG, dtype, tp=2)
    for rank, measured in tp_measured.items():
        held = measured["held", dtype]
        print(f"rank {rank}, {dtype}: {held:,.0f} bytes a token held, {estimated:,} estimated")
        assert held <= estimated <= 1.5 * held, (held, estimated)


def test_under_tp_the_loss_estimate_is_what_the_loss_over_the_vocabularys_shards_holds_at_its_peak(tp_measured):
    """vocabulary_parallel_loss computes a chunk of tokens' logits of this rank's V/tp entries at
    once (here every token's: 1,024 fit one chunk), and its gradients: what each vocabulary entry
    adds to the loss's peak (forward, or what forward keeps and backward's peak) is what the
    estimate's logits and the head's gradient add (within 1%: a few kilobytes come and go beside
    them). The whole vocabulary's logits would be twice it at tp 2; loss_parallel's, 6 times."""
    tokens = 1024
    def loss(vocab_size):
        estimate = memory.estimate(dataclasses.replace(TP_CONFIG, vocab_size=vocab_size, hidden_size=64), 1, tokens,
                                   torch.float32, shards=2, tp=2)
        return estimate.logits + estimate.head_gradient
    per_entry = (loss(16384) - loss(8192)) / (16384 - 8192)
    for rank, measured in tp_measured.items():
        print(f"rank {rank}: the loss's peak grows {measured['loss_per_entry']:,.0f} bytes a vocabulary entry, "
              f"{per_entry:,.0f} estimated")
        assert per_entry == pytest.approx(measured["loss_per_entry"], rel=0.01)


def test_under_tp_each_rank_holds_its_share_of_the_state_and_of_fsdps_groups(tp_measured):
    """At (dp 1, tp 2): the state of what each rank holds, its matrices' halves and the norms'
    gains whole; FSDP gathers a TP rank's share of its largest group, two at a time, in bf16.
    FSDP over "dp" then divides the state, as it does without TP."""
    two, four = (memory.estimate(TP_CONFIG, 4, 64, torch.bfloat16, shards=n, tp=2) for n in (2, 4))
    for measured in tp_measured.values():
        assert two.state == memory.BYTES_PER_PARAMETER * measured["parameters"]
        assert two.copies == 2 * 2 * measured["largest_group"]
    assert (four.state, four.snapshot) == (two.state // 2, two.snapshot // 2)
    assert four.activations == two.activations and four.logits == two.logits  # each TP group's micro-batch


def test_the_check_counts_what_tp_divides(monkeypatch):
    """train_tp.py's Check at (dp 1, tp 2) makes the estimate at tp 2: memory for just that is
    enough, with not a word, and a byte less is warned about. (Counted as if each rank computed
    its whole layer, this model and batch would need another amount: one of the two would fail.)"""
    cfg = config.parse_args(["--model", "tiny", "--seq-len", "512", "--tp", "2"], distributed=True, tensor=True)
    split, whole = (memory.estimate(TP_CONFIG, 16, 512, torch.float32, shards=2, tp=tp) for tp in (2, 1))
    assert split.total != whole.total
    warned = []
    monkeypatch.setattr(memory, "warn", warned.append)
    for available, warnings in ((split.total, 0), (split.total - 1, 1)):
        monkeypatch.setattr(memory, "device_memory", lambda device: (split.total, available))
        memory.Check(cfg, 16, torch.float32, torch.device("cpu"), shards=2)(TP_CONFIG.vocab_size)
        assert len(warned) == warnings
