"""Re-derive the multiples in conftest.py (FLOOR_MULTIPLE, BF16_MULTIPLE) on this machine.

    python tests/calibrate_tolerances.py /tmp/calibration            # this CPU's kernels
    ATEN_CPU_CAPABILITY=default python tests/calibrate_tolerances.py /tmp/calibration-default
    ONEDNN_MAX_CPU_ISA=AVX2 python tests/calibrate_tolerances.py /tmp/calibration-avx2  # oneDNN's bf16 kernels

Trains the suite's runs (the tests' FAST settings) and prints, for every pair the tests
compare to rounding, its distance as a multiple of the rounding floor, then the same for the
mutants the bounds must catch (tests/perturb.py). A bound belongs well above the first kind
and well below the second. Takes about 2 minutes on 2 cores (compile runs included, except
under ATEN_CPU_CAPABILITY=default, where torch.compile's C++ does not build).
"""

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import (BF16, FAST, FP32_LIKE_BF16, load_weights, loss_distance, max_weight_diff, measure_floor,
                      run_script, write_corpus)  # noqa: E402

root = Path(sys.argv[1])
root.mkdir(parents=True, exist_ok=True)
corpus = write_corpus(root / "corpus.txt")
compiles = os.environ.get("ATEN_CPU_CAPABILITY") != "default"


def run(name, script, extra=(), nproc=0, perturb=None):
    out = root / name
    if not (out / "model.pt").exists():  # not trained yet, or interrupted: train it (again)
        shutil.rmtree(out, ignore_errors=True)
        run_script(script, ["--dataset", str(corpus), *FAST, "--out-dir", str(out), *extra], nproc=nproc,
                   wrapper="tests/perturb.py" if perturb else None, env={"PERTURB": perturb} if perturb else None)
    return out


def report(label, a, b, floor, weights=True):
    w = max_weight_diff(load_weights(a), load_weights(b))
    loss = loss_distance(a, b)  # not max_loss_diff: a mutant's logged LR differs, and that is the point
    shown = f"weights {w:.2e} = {w / floor.weights:8.1f}x   " if weights else " " * 31
    print(f"  {label:<44}{shown}losses {loss:.2e} = {loss / floor.loss:8.1f}x", flush=True)


ACCUM = ["--grad-accum", "2"]
dp, ddp2, fsdp2 = run("dp", "train_dp.py"), run("ddp2", "train_ddp.py", nproc=2), run("fsdp2", "train_fsdp.py", nproc=2)
floor = measure_floor(dp, run("dp_reversed", "train_dp.py", perturb="reverse-batches"))
print(f"fp32 floor: weights {floor.weights:.2e}, losses {floor.loss:.2e} (relative)")
report("DDP(2) vs one process", ddp2, dp, floor)
report("grad-accum 2 vs none", run("dp_accum2", "train_dp.py", ACCUM), dp, floor)
report("DDP(2) grad-accum 2 vs one process", run("ddp2_accum2", "train_ddp.py", ACCUM, nproc=2), dp, floor)
report("FSDP(2) vs DDP(2)", fsdp2, ddp2, floor)
report("FSDP(2) grad-accum 2 vs FSDP(2)", run("fsdp2_accum2", "train_fsdp.py", ACCUM, nproc=2), fsdp2, floor)
if compiles:
    report("compiled vs eager", run("dp_compiled", "train_dp.py", ["--compile"]), dp, floor)
report("MUTANT one micro-batch dropped", run("m_drop", "train_dp.py", ACCUM, perturb="drop-micro-batch"), dp, floor)
report("MUTANT LR schedule one step ahead", run("m_lr", "train_dp.py", perturb="lr-off-by-one"), dp, floor)
report("MUTANT each rank's own mean (DDP)", run("m_rank", "train_ddp.py", nproc=2, perturb="per-rank-mean"), dp, floor)

bf16 = run("dp_bf16", "train_dp.py", BF16)
dp_short = run("dp_short", "train_dp.py", FP32_LIKE_BF16)
bf16_floor = measure_floor(dp_short, run("dp_short_bf16_weights", "train_dp.py", FP32_LIKE_BF16,
                                       perturb="bf16-weights"))
print(f"bf16 floor: losses {bf16_floor.loss:.2e} (relative; weights are not compared in bf16)")
report("bf16 vs fp32", bf16, dp_short, bf16_floor, weights=False)
fsdp1_bf16 = run("fsdp1_bf16", "train_fsdp.py", BF16)
report("FSDP(2) bf16 vs FSDP(1) bf16", run("fsdp2_bf16", "train_fsdp.py", BF16, nproc=2), fsdp1_bf16, bf16_floor,
       weights=False)
report("FSDP(1) bf16 vs fp32 (by design, not tested)", fsdp1_bf16, dp_short, bf16_floor, weights=False)
if compiles:
    report("DDP(2) bf16 + compile vs fp32", run("ddp2_bf16_compiled", "train_ddp.py", [*BF16, "--compile"], nproc=2),
           dp_short, bf16_floor, weights=False)
report("MUTANT bf16, one micro-batch dropped", run("m_bf16_drop", "train_dp.py", [*BF16, *ACCUM],
                                                   perturb="drop-micro-batch"), bf16, bf16_floor, weights=False)
report("MUTANT bf16, LR schedule one step ahead", run("m_bf16_lr", "train_dp.py", BF16, perturb="lr-off-by-one"), bf16,
       bf16_floor, weights=False)
