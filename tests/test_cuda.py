"""What only a GPU can show: NCCL, bf16 on tensor cores, torch.compile on CUDA, the SDPA
kernels, flex attention (--pack), DataParallel's replica threads, FSDP2 with NCCL. Skipped
without a CUDA GPU; run them on one with

    python -m pytest tests/test_cuda.py -v

Every behaviour here also has a CPU test elsewhere; these check that the CUDA paths work."""

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import FAST, FLOOR_MULTIPLE, assert_learns, assert_within, load_weights, max_weight_diff, metrics, run_script
from model import LlamaConfig, LlamaForPretraining, LlamaLMHead, compute_dtype
from test_packing import (attended, attention_inputs, both_layouts, bounds_from_positions, in_one_call,
                          packed_in_padded_order, padded_reference, relative_distance, small_model, with_flex)
from ops import packed_attention
from test_hf_import import hf  # noqa: F401 (fixture)
from test_stream_training import STREAM, shards, streamed, sub_streams_at  # noqa: F401 (fixtures)
from training import launch, weights
from training.metrics import peak_tflops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 and compile on the GPU; --dtype auto must pick bf16 on any GPU from Ampere on
GPU_FAST = [*FAST[:FAST.index("--dtype")], "--dtype", "bf16", "--compile"]


@pytest.fixture
def full_fp32():
    """fp32 matmuls in full fp32 for the test, whatever ran before it: a CUDA run sets TF32
    ("high") for its process (launch.compute_dtype), and under it flex's fp32 kernel was 2.7e-4
    from an fp32 reference, 31,000x the floor, where in full fp32 it is 2.5e-7."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module")
def small_config():
    return LlamaConfig(vocab_size=128, max_position_embeddings=256, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)


def test_auto_is_bf16_on_this_gpu_when_it_computes_bf16_natively(full_fp32):  # (which it sets back)
    gpu = torch.device("cuda", 0)
    native = torch.cuda.get_device_capability(gpu) >= (8, 0)
    assert launch.compute_dtype("auto", gpu) == (torch.bfloat16 if native else torch.float32)


def last_checkpoint_weights(out, tmp_path) -> dict:
    """The model weights in a run's step-8 checkpoint: checkpoint.pt, or train_fsdp.py's shards
    gathered into one file by DCP's own converter."""
    if (out / "checkpoint.pt").exists():
        return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(out / "checkpoint-00000008", tmp_path / "gathered.pt")
    return torch.load(tmp_path / "gathered.pt", map_location="cpu", weights_only=True)["model"]


def gpu_run(runs, script, nproc=0, extra=()):
    """A GPU training run, memoized under one name for every test that reads it, and launched by
    the real torchrun, as a user launches on a GPU (tests/torchrun_forked.py is the CPU suite's)."""
    return runs(f"cuda_{script}{''.join(extra)}", script, [*GPU_FAST, *extra], nproc=nproc, real_torchrun=True)


def trains_resumes_and_loads(runs, tmp_path, script, nproc, extra=()):
    gpu_fast = [*GPU_FAST, *extra]
    straight = gpu_run(runs, script, nproc, extra)
    rows = [row for row in metrics(straight) if "loss" in row]
    assert_learns(rows)
    if peak_tflops(torch.device("cuda", 0), torch.bfloat16):  # a GPU whose peak we know
        assert 0 < rows[-1]["mfu"] < 1
    # the allocator's peaks since the previous row: the weights alone are there, reserved holds allocated
    assert all(0 < row["max_memory_allocated_gib"] <= row["max_memory_reserved_gib"] for row in rows)
    model, _ = weights.load_trained(straight)  # plain keys, fp32, loads strictly
    last = last_checkpoint_weights(straight, tmp_path)  # step 8's, written by another code path
    assert model.state_dict().keys() == last.keys()
    assert all(v.dtype == torch.float32 and torch.equal(v, last[k].float()) for k, v in model.state_dict().items())
    # stopped at step 4 and resumed on the GPU: the same run, to GPU rounding
    half = tmp_path / "half"
    run_script(script, ["--dataset", str(runs.corpus), *gpu_fast, "--out-dir", str(half), "--stop-at-step", "4"],
               nproc=nproc, real_torchrun=True)
    run_script(script, ["--dataset", str(runs.corpus), *gpu_fast, "--out-dir", str(half), "--resume"], nproc=nproc,
               real_torchrun=True)
    assert max_weight_diff(load_weights(straight), load_weights(half)) < 1e-2
    return straight


def test_train_dp_in_bf16_with_compile_trains_resumes_and_writes_plain_weights(runs, tmp_path):
    trains_resumes_and_loads(runs, tmp_path, "train_dp.py", nproc=0)


def test_train_ddp_under_torchrun_with_nccl_in_bf16_with_compile(runs, tmp_path):
    out = trains_resumes_and_loads(runs, tmp_path, "train_ddp.py", nproc=1)
    assert (out / "model.pt").exists()


def test_train_fsdp_under_torchrun_with_nccl_in_bf16_with_compile(runs, tmp_path):
    """FSDP2 on one GPU: NCCL, the bf16 MixedPrecisionPolicy, per-layer compile, sharded
    checkpoints written from the background (async_save) and read back over NCCL on resume,
    and model.pt gathered at the end into a plain state_dict."""
    out = trains_resumes_and_loads(runs, tmp_path, "train_fsdp.py", nproc=1)
    assert (out / "checkpoint-00000008" / ".metadata").is_file() and not list(out.glob("*.tmp"))


def test_dataparallel_replicas_compute_in_bf16(small_config):
    """parallel_apply runs each replica in its own thread, where autocast's dtype defaults to
    fp16; the model's own autocast keeps them in bf16. Two replicas share one GPU here."""
    from torch.nn.parallel import parallel_apply
    model = LlamaForPretraining(small_config).cuda()
    model.compute_dtype = torch.bfloat16
    replicas = [model, copy.deepcopy(model)]
    dtypes = set()  # what each matmul computes in
    for replica in replicas:
        for m in replica.modules():
            if isinstance(m, LlamaLMHead):  # returns the fp32 loss: the dtype of its logits' matmuls
                m.register_forward_pre_hook(lambda m, args: dtypes.add(compute_dtype(args[0])))
            elif isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda m, args, out: dtypes.add(out.dtype))
    x = torch.randint(0, 128, (2, 64), device="cuda")
    for outer in (False, True):  # with or without an autocast around DataParallel
        with torch.autocast("cuda", enabled=outer):
            outputs = parallel_apply(replicas, [(x, x), (x, x)], devices=[0, 0])
        assert dtypes == {torch.bfloat16}
        assert all(loss_sum.dtype == torch.float32 for loss_sum, _ in outputs)


def test_sdpa_serves_gqa_with_the_flash_kernel_in_bf16_and_a_memory_efficient_one_in_fp32(small_config, full_fp32):
    """Only the flash kernel takes enable_gqa, and only in bf16/fp16; in fp32 the model
    repeats the key/value heads so that the memory-efficient kernel runs, not the math one."""
    if torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("the flash kernel needs compute capability 8.0")
    model = LlamaForPretraining(small_config).cuda()
    x = torch.randint(0, 128, (2, 256), device="cuda")
    model.compute_dtype = torch.bfloat16
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if the flash kernel cannot serve it
        bf16 = model(x)
    model.compute_dtype = torch.float32
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        fp32 = model(x)
    with sdpa_kernel(SDPBackend.MATH):
        math = model(x)
    torch.testing.assert_close(fp32, math, atol=1e-4, rtol=1e-4)
    assert (bf16.float() - fp32).abs().max() < 0.1


def test_generate_on_the_gpu(runs):
    out = gpu_run(runs, "train_dp.py")
    proc = run_script("tools/generate.py", [str(out), "--prompt", "the model", "--max-new-tokens", "16", "--temperature", "0"])
    assert proc.stdout.startswith("the model") and len(proc.stdout) > len("the model\n")
    assert run_script("tools/generate.py", [str(out), "--prompt", "the model", "--max-new-tokens", "16",
                                      "--temperature", "0"]).stdout == proc.stdout


def same_state(a, b) -> bool:
    """Two sub-stream states (ints, strs, dicts, the packer's tensor of tokens) alike, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    return a == b


def test_a_streamed_run_on_the_gpu_reads_what_a_cpu_run_reads_and_resumes(streamed, tmp_path):
    """--stream --pack on CUDA (DDP under NCCL on one GPU, bf16, compiled): after the same steps
    every sub-stream stands where a CPU run's does (the rows do not depend on the device: the
    GPU's are pinned and copied by the read-ahead), and stopped at step 4 and resumed, the run
    trains on to GPU rounding."""
    on_cpu = {"--device": "cpu", "--dtype": "fp32"}
    gpu = [*[a for i, a in enumerate(STREAM) if a not in on_cpu and STREAM[i - 1] not in on_cpu],
           "--dtype", "bf16", "--compile", "--pack"]
    cpu_run = streamed("ddp1_packed", "train_ddp.py", ["--pack"], nproc=1)
    runs = {}
    for name, extra in [("straight", []), ("half", ["--stop-at-step", "4"]), ("half", ["--resume"])]:
        runs[name] = tmp_path / name
        run_script("train_ddp.py", ["--dataset", str(streamed.shards), *gpu, "--out-dir", str(runs[name]), *extra],
                   nproc=1, real_torchrun=True)
    for step in (4, 8):
        assert same_state(sub_streams_at(runs["straight"], step), sub_streams_at(cpu_run, step))
    assert max_weight_diff(load_weights(runs["straight"]), load_weights(runs["half"])) < 1e-2


def test_the_cluster_check_on_a_gpu_reports_it_and_checks_nccl():
    """One rank per GPU (as many as there are): the GPU's name, torch's CUDA and NCCL versions,
    a correct all-reduce over NCCL and over gloo; with several GPUs, their bus bandwidth."""
    gpus = torch.cuda.device_count()
    proc = run_script("tools/check_cluster.py", ["--timeout-seconds", "60"], nproc=gpus, real_torchrun=True)
    print(proc.stdout)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    rows = [line for line in proc.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == gpus and all(torch.cuda.get_device_name(0) in row and nccl in row for row in rows)
    assert f"all-reduce over nccl: correct on every rank ({gpus})" in proc.stdout
    assert f"all-reduce (gloo) over gloo: correct on every rank ({gpus})" in proc.stdout


# ---- --pack on the GPU: flex attention with a BlockMask (packed_attention) ---------------------

def on_gpu(*tensors, dtype=None):
    """Leaf copies on the GPU (floating ones in dtype, requiring grad where the original did)."""
    return [t.detach().to("cuda", dtype if t.is_floating_point() and dtype else t.dtype).requires_grad_(t.requires_grad)
            for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_computes_the_packed_mask_forward_and_backward(dtype, full_fp32):
    """Compiled flex attention under the BlockMask against the plain formulation (one SDPA call
    under the whole mask), the output and the gradients of q, k and v. 600 positions: not a
    multiple of flex's blocks of 128. The floor: the plain formulation by SDPA's math kernel
    against its default one (the same sums, in another order)."""
    inputs = on_gpu(*attention_inputs(600, D=64), dtype=dtype)
    plain = attended(in_one_call, *inputs)
    with sdpa_kernel(SDPBackend.MATH):
        math = attended(in_one_call, *inputs)
    floor = max(relative_distance(math, plain), torch.finfo(dtype).eps)
    assert_within(f"flex vs SDPA, {dtype}", relative_distance(attended(with_flex, *inputs), plain), floor,
                  FLOOR_MULTIPLE)


@pytest.mark.skipif(not packed_attention.varlen_with_gqa(), reason="varlen_attn serves GQA from torch 2.12")
def test_varlen_attention_over_the_windows_computes_the_packed_mask_forward_and_backward(full_fp32):
    """--packed-attention varlen: CUDA's varlen_attn (flash attention: bf16) over the loader's
    cu_seqlens against the plain formulation, output and gradients; the floor as for flex."""
    dtype = torch.bfloat16
    q, k, v, position_ids = attention_inputs(600, D=64)
    cu_seqlens = bounds_from_positions(position_ids, int((position_ids == 0).sum(1).max()) + 2)
    inputs = on_gpu(q, k, v, position_ids, dtype=dtype)
    plain = attended(in_one_call, *inputs)
    with sdpa_kernel(SDPBackend.MATH):
        math = attended(in_one_call, *inputs)
    floor = max(relative_distance(math, plain), torch.finfo(dtype).eps)
    windows = packed_attention.window_mask(inputs[3], dtype, cu_seqlens.cuda())

    def with_varlen(q, k, v, position_ids):
        return packed_attention.attention(q, k, v, windows)
    assert_within(f"varlen vs SDPA, {dtype}", relative_distance(attended(with_varlen, *inputs), plain), floor,
                  FLOOR_MULTIPLE)


@pytest.mark.parametrize("device", ["cuda:0", "cuda"])  # train_dp.py's is "cuda": the current GPU
def test_the_read_ahead_copies_each_step_onto_the_gpu_as_the_loader_gives_it(device):
    """Pinned by the loader, copied on the reader's own stream, waited for by the step's."""
    from training.read_ahead import ReadAhead
    items = torch.utils.data.TensorDataset(torch.arange(64).view(16, 4), torch.arange(64).view(16, 4) * 2)
    loader = torch.utils.data.DataLoader(items, batch_size=2, pin_memory=True)
    steps = list(ReadAhead(loader, grad_accum=2, device=torch.device(device), steps=4))
    on_gpu_rows = [t for step in steps for batch in step for t in batch]
    assert all(t.is_cuda for t in on_gpu_rows)
    assert all(torch.equal(t.cpu(), want) for t, want in zip(on_gpu_rows, [t for batch in loader for t in batch]))


def test_a_packed_row_on_the_gpu_computes_what_its_windows_compute_alone(full_fp32):
    """test_packing's per-token proof on the GPU (fp32): packed rows through flex attention,
    padded ones through SDPA's is_causal kernel. The floor: the padded rows under SDPA's math
    kernel against its default one, or in reverse order."""
    model = small_model().cuda()
    padded, packed, packing = both_layouts()
    padded, packed = on_gpu(*padded), on_gpu(*packed)
    plain, floor = padded_reference(model, padded)
    with sdpa_kernel(SDPBackend.MATH):
        math, _ = padded_reference(model, padded)
    floor = max(floor, relative_distance(math, plain))
    assert_within("packed vs padded on the GPU", relative_distance(packed_in_padded_order(model, packed, packing,
                                                                                          padded[1]), plain),
                  floor, FLOOR_MULTIPLE)


def test_train_dp_packed_in_bf16_with_compile_trains_resumes_and_writes_plain_weights(runs, tmp_path):
    trains_resumes_and_loads(runs, tmp_path, "train_dp.py", nproc=0, extra=["--pack"])


@pytest.mark.skipif(not packed_attention.varlen_with_gqa(), reason="varlen_attn serves GQA from torch 2.12")
def test_train_ddp_packed_with_varlen_attention(runs, tmp_path):
    trains_resumes_and_loads(runs, tmp_path, "train_ddp.py", nproc=1, extra=["--pack", "--packed-attention", "varlen"])


def test_train_fsdp_packed_with_each_layer_compiled(runs, tmp_path):
    """FSDP compiles each decoder layer: flex attention runs inside the compiled layers, the
    BlockMask is made once outside them."""
    trains_resumes_and_loads(runs, tmp_path, "train_fsdp.py", nproc=1, extra=["--pack"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_train_tp_over_two_gpus_with_nccl_trains_resumes_and_follows_fsdp(runs, tmp_path):
    """train_tp.py --tp 2 on two GPUs (NCCL, bf16, compiled, packed): it learns, resumes, and
    its losses follow train_fsdp.py's on the same two GPUs as bf16 lets them (the CPU suite
    holds the exact comparisons: tests/test_train_tp.py)."""
    tp = trains_resumes_and_loads(runs, tmp_path, "train_tp.py", nproc=2, extra=["--pack", "--tp", "2"])
    fsdp = gpu_run(runs, "train_fsdp.py", nproc=2, extra=["--pack"])
    losses = [[row["loss"] for row in metrics(run) if "loss" in row] for run in (tp, fsdp)]
    assert len(losses[0]) == len(losses[1]) and max(abs(a - b) / b for a, b in zip(*losses)) < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_dataparallel_scatters_the_row_structure_with_the_rows(full_fp32):
    """Real nn.DataParallel over two GPUs: each replica gets its rows' position_ids and builds
    its own BlockMask; the gathered loss is the one module's over the whole batch. The floor:
    the whole batch in reverse order."""
    model = small_model().cuda()
    batch = on_gpu(*both_layouts()[1])
    with torch.no_grad():
        whole = model(*batch)[0]
        flipped = model(*(t.flip(0) for t in batch))[0]
        split = torch.nn.DataParallel(model, device_ids=[0, 1])(*batch)[0].sum()
    floor = max(((flipped - whole).abs() / whole).item(), torch.finfo(torch.float32).eps)
    assert_within("DataParallel vs one module", ((split - whole).abs() / whole).item(), floor, FLOOR_MULTIPLE)


# ---- the step's candidates (benchmarks/gpu_report.py), compiled on the GPU ----------------------

def loss_and_gradients(model, x, y) -> list[torch.Tensor]:
    loss_sum, n_tokens = model(x, y)
    (loss_sum.sum() / n_tokens.sum()).backward()
    return [loss_sum.detach(), *(p.grad for p in model.parameters())]


def candidate_distances(config, device) -> dict:
    """Each candidate of step_rows.CANDIDATES, compiled in bf16 as train_ddp.py compiles (each layer and the
    LM head), its loss and every gradient against the fp32 model's (relative, the farthest tensor); and the
    baseline's, compiled the same way without it: bf16's own distance, the floor."""
    from benchmarks.step_rows import CANDIDATES
    torch.manual_seed(0)
    plain = LlamaForPretraining(config).to(device)
    plain.lm_head.chunk_tokens = 96  # a few chunks of the 4 x 64 tokens (the chunked loss)
    x = torch.randint(0, config.vocab_size, (4, 64), device=device)
    y = torch.where(torch.rand(x.shape, device=device) < 0.1, -100, torch.roll(x, -1, 1))  # some ignored
    reference = loss_and_gradients(copy.deepcopy(plain), x, y)
    distances = {}
    for name, turn_on in [("baseline", lambda model: None), *((n, c[1]) for n, c in CANDIDATES.items())]:
        model = copy.deepcopy(plain)
        model.compute_dtype = torch.bfloat16
        turn_on(model)
        for block in [*model.base_model.layers, model.lm_head]:
            block.compile()
        distances[name] = relative_distance(loss_and_gradients(model, x, y), reference)
    return distances


def test_the_steps_candidates_compiled_in_bf16_train_what_the_baseline_trains(small_config, full_fp32):
    """Each candidate gpu_report.py measures (fused projections, the chunked loss under compile) computes,
    compiled in bf16 on the GPU, the loss and gradients of the fp32 model as closely as the baseline does:
    within 2x of bf16's own distance (CPU equivalents: tests/test_fused_projections.py, test_chunked_loss.py)."""
    distances = candidate_distances(small_config, torch.device("cuda"))
    floor = distances.pop("baseline")
    for name, distance in distances.items():
        assert_within(name, distance, floor, 2)


def test_an_imported_tied_model_on_the_gpu_is_transformers_and_fsdp_trains_it(hf, corpus, tmp_path, full_fp32):
    """tests/test_hf_import.py's import on a GPU: our fp32 logits within 20x what transformers' own
    two attention kernels differ by there, and train_fsdp.py (NCCL, bf16) trains the tied
    SmolLM2-shaped model 4 steps to finite weights, still tied in model.pt."""
    from test_hf_import import hf_args, imported, published, tied
    ours, theirs = imported(hf["smollm"]).cuda(), published(hf["smollm"]).cuda()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), device="cuda")
    with torch.no_grad():
        logits, expected = ours(ids), theirs(ids).logits
        other = published(hf["smollm"], "eager").cuda()(ids).logits
    floor = max((other - expected).abs().max().item(), torch.finfo(torch.float32).eps * expected.abs().max().item())
    assert_within("logits on the GPU", (logits - expected).abs().max().item(), floor, FLOOR_MULTIPLE)
    out = tmp_path / "fsdp"
    run_script("train_fsdp.py", [*hf_args(hf["smollm"], corpus, out), "--dtype", "bf16"], nproc=1, real_torchrun=True)
    assert tied(out) and all(bool(torch.isfinite(w).all()) for w in load_weights(out).values())
