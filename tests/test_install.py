"""Installing and launching as users do: pip keeps the torch they chose, and a machine whose
GPUs torch cannot see never trains on its CPU in silence. (Slurm's launch: test_failures.py.)"""

import os

import pytest
import torch
from packaging.requirements import Requirement

from conftest import FAST, REPO, run_in_process, script_in_process
from training import launch

SCRIPTS = ["train_dp.py", "train_ddp.py", "train_fsdp.py"]


def test_requirements_admit_every_torch_from_2_11_on_so_pip_keeps_the_one_installed():
    """pip leaves an installed package alone when it satisfies the requirement: a range keeps
    a user's CUDA (or CPU) build, where a pin would replace it. Its floor is the lowest torch
    the whole suite passes on (docs/install.md): 2.10 and older are replaced."""
    [torch_req] = [Requirement(line.split("#")[0]) for line in (REPO / "requirements.txt").read_text().splitlines()
                   if line.startswith("torch")]
    for version in ("2.11.0", "2.12.0+cu130", "2.13.0", "2.14.1+cu130", "3.0.0"):
        assert torch_req.specifier.contains(version, prereleases=False), version
    for version in ("2.10.0", "2.5.1"):  # 2.10: --device cpu FSDP on a GPU machine; 2.5-2.9: far more
        assert not torch_req.specifier.contains(version), version
    assert torch_req.specifier.contains(torch.__version__.split("+")[0])


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpus_that_torch_cannot_see_stop_the_run_with_one_line(script, corpus, tmp_path, monkeypatch, capsys):
    """A node with 8 GPUs and a CPU build of torch (or a CUDA build newer than its driver)
    would train on the CPU with gloo, saying only "device cpu". It stops before anything is
    written, and says what torch was built for and what to do."""
    monkeypatch.setattr(launch, "nvidia_gpus", lambda: [f"/dev/nvidia{i}" for i in range(8)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as such a torch says
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU-only build
    out = tmp_path / "run"
    assert script_in_process(script, ["--dataset", str(corpus), *FAST, "--out-dir", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: this machine has NVIDIA GPUs (/dev/nvidia0, /dev/nvidia1, ...) but torch {torch.__version__} sees "
        "none: it is a CPU-only build. Install the torch build for your driver "
        "(https://pytorch.org/get-started/locally/), or pass --device cpu to train on the CPU\n")
    assert not out.exists()


def test_device_cpu_trains_on_the_cpu_on_purpose_where_gpus_are_present(corpus, tmp_path, monkeypatch):
    """The start-up line also gives the cores the process may use (3 here, as a scheduler's
    affinity would give it), not the machine's."""
    monkeypatch.setattr(launch, "nvidia_gpus", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    out = tmp_path / "run"
    printed = run_in_process("train_dp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(out), "--device", "cpu"])
    assert "| device cpu | 3 usable CPU cores |" in printed and (out / "model.pt").exists()


def test_device_cuda_without_a_gpu_torch_can_use_is_refused(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "nvidia_gpus", lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "run"
    assert script_in_process("train_ddp.py", ["--dataset", str(corpus), *FAST, "--out-dir", str(out),
                                              "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: --device cuda but torch {torch.__version__} sees none: it is a CUDA 13.0 build, which this driver "
        "may be too old for; CUDA_VISIBLE_DEVICES='' hides GPUs. Install")
    assert not out.exists()
