"""--activation-checkpointing: each decoder layer keeps only its inputs for backward and runs
its forward again there. It changes what is stored, never what is computed: on a CPU the
weights it trains are bitwise those of a run without it, in every script."""

import pytest
import torch

from conftest import FAST, assert_same_model, ddp_two_ranks, spied, stopped_at_step_4, train
from model import PRESETS, LlamaConfig, LlamaDecoderLayer, LlamaForPretraining
from test_fsdp import fsdp_two_ranks

AC = ["--activation-checkpointing"]


def test_each_layer_stores_only_its_inputs_and_runs_twice(monkeypatch):
    """Without it a layer runs once and autograd saves its intermediate tensors; with it the
    layer runs again in backward, and what forward saves is a small part of that."""
    calls = []
    real_layer = LlamaDecoderLayer.layer
    monkeypatch.setattr(LlamaDecoderLayer, "layer", lambda self, *a, **k: calls.append(1) or real_layer(self, *a, **k))
    config = LlamaConfig(vocab_size=300, **PRESETS["tiny"])
    x = torch.randint(0, 300, (2, 64))
    saved, runs = {}, {}
    for on in (False, True):
        torch.manual_seed(0)
        model = LlamaForPretraining(config)
        if on:
            model.enable_activation_checkpointing()
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss = model.base_model(x).sum()  # the decoder alone: the layers' own saved tensors
        calls.clear()
        loss.backward()
        saved[on], runs[on] = sum(sizes), len(calls)
    assert runs == {False: 0, True: config.num_hidden_layers}  # in backward: recomputed, once a layer
    assert saved[True] < saved[False] / 5, saved
    with torch.no_grad():  # evaluation and generation store nothing anyway: no recomputation
        calls.clear()
        model(x)
        assert len(calls) == config.num_hidden_layers


@pytest.mark.parametrize("script, nproc, reference", [
    ("train_dp.py", 0, lambda runs: runs("dp", "train_dp.py")),
    ("train_ddp.py", 2, ddp_two_ranks),
    ("train_fsdp.py", 2, fsdp_two_ranks),
], ids=["dp", "ddp2", "fsdp2"])
def test_a_run_with_activation_checkpointing_trains_bitwise_the_same_weights(runs, script, nproc, reference):
    run = runs(f"{script.removesuffix('.py')}{nproc or ''}_ac", script, AC, nproc=nproc)
    assert_same_model(run, reference(runs))  # bitwise: the same arithmetic, done twice


@pytest.mark.compile
@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py"])
def test_compiled_with_activation_checkpointing_trains_the_same_model(runs, floor, script):
    """Compiled (under FSDP each layer, its recomputation inside), on 2 ranks: graphs are built
    and the model is the eager run's to rounding."""
    name = f"{script.removesuffix('.py')}2_compiled_ac"
    compiled, spy = spied(runs, name, script, ["--compile", *AC], nproc=2)
    assert len(spy) == 2 and all(rank["compiled_graphs"] > 0 for rank in spy)
    eager = ddp_two_ranks(runs) if script == "train_ddp.py" else fsdp_two_ranks(runs)
    assert_same_model(compiled, eager, floor)


def test_the_flag_may_change_on_resume(runs, tmp_path):
    """It decides what is stored, not what is trained: a run stopped at step 4 resumes with it
    and ends bitwise where the plain run ends."""
    half = stopped_at_step_4(runs, tmp_path)
    train("train_dp.py", ["--dataset", str(runs.corpus), *FAST, "--out-dir", str(half), "--resume", *AC])
    assert_same_model(half, runs("dp", "train_dp.py"))


def test_the_flag_reaches_every_decoder_layer_of_the_model_the_scripts_build():
    from training import build, config
    model = build.model(config.parse_args(["--vocab-size", "300", *AC]), 300, torch.float32)
    assert [layer.activation_checkpointing for layer in model.base_model.layers] == [True] * 4
    plain = build.model(config.parse_args(["--vocab-size", "300"]), 300, torch.float32)
    assert not any(layer.activation_checkpointing for layer in plain.base_model.layers)


def test_generation_with_gradients_enabled_fills_the_cache_as_without_it():
    """A KV cache is filled by each forward: the layer that recomputes in backward must not
    skip it. Prompt, then four tokens one at a time, outside torch.no_grad()."""
    config = LlamaConfig(vocab_size=300, **PRESETS["tiny"])
    torch.manual_seed(0)
    plain = LlamaForPretraining(config)
    checkpointed = LlamaForPretraining(config)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.enable_activation_checkpointing()
    x = torch.randint(0, 300, (1, 12))
    outputs = []
    for model in (plain, checkpointed):
        caches = model.new_kv_caches(1, 12)
        outputs.append(torch.cat([model(x[:, :8], kv_caches=caches)] +
                                 [model(x[:, t:t + 1], kv_caches=caches) for t in range(8, 12)], dim=1))
    assert torch.equal(outputs[0], outputs[1])
