"""Where a step's time goes, by kind of work: the matmuls, attention, the loss, the optimizer,
communication and the rest. tools/trace_summary.py prints it for each traced step, and its
kernel_time_by_kind gives it to a benchmark.

What is counted: on a GPU each kernel launched within the step's mark on the host (whole: the
trainer waits for its kernels before it ends the mark), by its own duration. Kernels that run at
once are each counted (on two streams; or on one, as cuBLAS's split-K reduction starts before
its matmul ends: 13 µs a step in the H100's trace, tests/fixtures/), so the kinds may sum to
more than the kernels' union, trace_summary's compute. That union is also taken within the GPU's
own mark of the step, which ends before the optimizer's kernels (as the H100's trace shows, it
spans the GPU work launched in the step outside any mark inside it; the optimizer's, inside
Optimizer.step#'s own mark, comes after it): in the H100's step 25, compute is 73.9 ms and the
kinds 75.8, AdamW's 1.9 ms among them. A kernel whose launch the trace does not hold counts for
its part within the GPU's mark, as in compute. On a CPU, which runs no kernels: each ATen
operator's own time on the training thread (without the operators it calls): compute's parts.

A kernel's kind is what its name says (kind_of); one whose name says nothing (the rest's) is
the kind of the mark it was launched in (MARKS), if any: the optimizer's step, and the chunked
loss (ops/chunked_loss.py), both loops of aten::add_, aten::mul_, aten::exp_ ... that no name
tells apart from the model's (the chunked loss's matmuls stay matmuls, as the compiled loss's
LM head does). Names, as the H100's trace shows them:
  matmul         cuBLAS's (nvjet_sm90_..., sm90_xmma_gemm_..., cutlass_80_tensorop_..._gemm) and
                 its split-K reduction (cublasLt::splitKreduce_kernel); Inductor's templates
                 (triton_tem_fused_mm_...: its one template here that is not attention); ATen's
                 mm, addmm, bmm, matmul and linear
  attention      flex's (triton_tem_fused_flex_attention_..., and its backward's reduction that
                 prepares it), flash's, cuDNN's sdpa and the efficient kernel (fmha_cutlass...)
  loss           the LM head's cross-entropy: log_softmax and nll_loss forward and backward,
                 compiled (triton_red_fused__log_softmax_..._nll_loss_...) or ATen's
                 (cunn_SoftMaxForward<..., LogSoftMaxForwardEpilogue>, nll_loss_forward_...)
  optimizer      the multi-tensor kernels of AdamW's fused or foreach step and of the gradient
                 clipping before it (_foreach_norm, _foreach_mul_)
  communication  NCCL's kernels
  rest           everything else: norms, RoPE, SwiGLU, casts, residual adds, the embedding's
                 backward, DDP's scaling of the gradients (rest_top names the largest)
The kinds are tried in that order, the first with a pattern in the name (in any case) wins: a
name that two match (fmha_cutlassF is attention, not a cutlass matmul; a compiled log_softmax
whose name holds the LM head's mm it reads is the loss) goes to the earlier.
"""

from ops.chunked_loss import ChunkedCrossEntropy

MATMUL, ATTENTION, LOSS, OPTIMIZER, COMMUNICATION, REST = (
    "matmul", "attention", "loss", "optimizer", "communication", "rest")
KINDS = (MATMUL, ATTENTION, LOSS, OPTIMIZER, COMMUNICATION, REST)  # as printed

PATTERNS = {  # lower case; tried in this order (the docstring says why)
    COMMUNICATION: ("nccl",),
    ATTENTION: ("attention", "flash", "fmha", "sdpa"),
    LOSS: ("log_softmax", "logsoftmax", "nll_loss", "cross_entropy"),
    OPTIMIZER: ("adam", "multi_tensor_apply", "foreach", "lpnorm_cleanup"),
    MATMUL: ("gemm", "gemv", "nvjet", "xmma", "cutlass", "splitkreduce", "triton_tem_",
             "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"),
}
OPTIMIZER_MARK = "Optimizer.step#"  # what torch.optim marks each step with (Optimizer.step#AdamW.step)
# the marks whose work is theirs, by the start of their names: the optimizer's, and the chunked loss's
# forward (its autograd Function) and backward (ChunkedCrossEntropyBackward), on any thread
MARKS = {OPTIMIZER_MARK: OPTIMIZER, ChunkedCrossEntropy.__name__: LOSS}
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the host's calls that launch kernels (cudaLaunchKernel, cuLaunchKernel)
TOP = 10  # rest_top: the largest of the rest, by name


def kind_of(name: str) -> str:
    """The kind a kernel's (or an ATen operator's) name says: one of KINDS, REST when none."""
    lower = name.lower()
    return next((kind for kind, patterns in PATTERNS.items() if any(p in lower for p in patterns)), REST)


def communicates(name: str) -> bool:
    return kind_of(name) == COMMUNICATION


def marked(events: list[dict]) -> list[tuple]:
    """Each of MARKS in events: (its kind, its thread, start, end)."""
    return [(kind, thread(e), e["ts"], e["ts"] + e["dur"]) for e in events
            for mark, kind in MARKS.items() if e["name"].startswith(mark)]


def thread(event: dict) -> tuple:
    return event["pid"], event["tid"]


def kernel_work(kernels: list[dict], host: list[dict]) -> list[tuple]:
    """by_kind's work of a GPU trace: each kernel, and where and when the host's call that launched it
    (among host's events, the one with the same correlation id) began."""
    launches = {correlation(e): (thread(e), e["ts"]) for e in host
                if e.get("cat") in LAUNCHES and correlation(e) is not None}
    return [(k["name"], k["ts"], k["ts"] + k["dur"], launches.get(correlation(k))) for k in kernels]


def correlation(event: dict) -> int | None:
    found = event.get("args", {}).get("correlation")
    return found if isinstance(found, int) else None  # an edited trace's list is no id (nor a key)


def by_kind(work, step: tuple[float, float], window: tuple[float, float], marks) -> dict:
    """work: (name, start, end, launched): a kernel, or an operator's own interval, and where and when its
    launch began ((thread, µs); None: the trace does not say), in µs. The step's is what was launched
    within step (its mark on the host), whole; or, its launch unknown, its part within window (the GPU's
    mark of the step). Each is of the kind its name says, or the rest's the kind of the mark (marked's)
    it was launched in. Returns {"total_ms", "kinds": {kind: ms, each of KINDS}, "rest_top": [(name, ms),
    ...]}, the kinds summing to total_ms, rest_top the TOP largest names of the rest."""
    kinds, rest = dict.fromkeys(KINDS, 0.0), {}
    marks = [(kind, where, a, b) for kind, where, a, b in marks if a < step[1] and b > step[0]]  # this step's
    for name, start, end, launched in work:
        if launched is None:
            ms = max(0.0, min(end, window[1]) - max(start, window[0])) / 1000
        else:
            ms = (end - start) / 1000 if step[0] <= launched[1] < step[1] else 0.0
        if not ms:
            continue
        kind = kind_of(name)
        if kind == REST and launched is not None:
            kind = next((mark for mark, where, a, b in marks if where == launched[0] and a <= launched[1] < b), REST)
        kinds[kind] += ms
        if kind == REST:
            rest[name] = rest.get(name, 0.0) + ms
    return {"total_ms": sum(kinds.values()), "kinds": kinds,
            "rest_top": sorted(rest.items(), key=lambda item: -item[1])[:TOP]}


def step_by_kind(summary: dict) -> dict:
    """{"ms": the step's span (on a GPU the GPU's), "total_ms", "kinds", "rest_top"} of one of
    trace_summary.summarize's steps (by_kind's: the kernels' own durations, or on a CPU the operators' own time)."""
    return {"ms": summary["gpu"]["end"] - summary["gpu"]["start"] if "gpu" in summary else summary["ms"],
            **summary["kinds"]}


def describe(found: dict, what: str) -> list[str]:
    """Two lines: each kind's ms and share of the total, then the rest's three largest."""
    total = found["total_ms"]
    shares = " | ".join(f"{kind} {ms:.1f}" + (f" ({ms / total:.0%})" if ms else "")
                        for kind, ms in found["kinds"].items())
    largest = ", ".join(f"{short(name)} {ms:.1f}" for name, ms in found["rest_top"][:3])
    return [f"{what} by kind: {total:.1f} ms | {shares}", f"  the rest's largest: {largest or 'none'}"]


def short(name: str, width: int = 60) -> str:
    """A kernel's name for a line: ATen's C++ names run to hundreds of characters."""
    name = name.removeprefix("void ").replace("at::native::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[:width - 3] + "..."
