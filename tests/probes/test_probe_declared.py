"""-p values of the repository's own notebooks from issue 43: each refused before any kernel starts, exit status 2,
naming the parameter, the notebook, the value and the declared choices or range; on 4414cd0 each was typed and
handed to the kernel, which refused it 36-85 s in (or allocated 51 GB). And a build lock that is a folder or a
named pipe is refused before any notebook runs.

The notebooks' parameters cells declare what they allow beside each default (`report/parameters.py`):
`choices: a | b` (each element, for a list), `range: LO..HI`, `multiple of: N`, `length: N`, and
`input: F x F x ... bytes` (the input tensor, checked against the machine's memory).
"""

from __future__ import annotations

import os

import pytest
from probe_cases import REPO, make_notebooks, run_cli, use_fake

from workbench.report import declarations

NOTEBOOKS = REPO / "notebooks"
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")


@pytest.fixture
def fake(monkeypatch):
    return use_fake(monkeypatch)


def _refused(tmp_path, capsys, fake, notebook, *args) -> str:
    capsys.readouterr()
    assert run_cli(NOTEBOOKS, tmp_path / "r", notebook, "--profile", "smoke", *args) == 2
    assert not fake.calls and not (tmp_path / "r").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize("notebook, arg, shown", [
    ("advisor", "device=tpu", ["device='tpu'", "'' | cpu | cuda"]),
    ("tour", "device=tpu", ["device='tpu'", "cuda:0..63"]),
    ("optorch", "device=tpu", ["device='tpu'", "auto | cpu | cuda"]),
    ("calcgraph", "device=tpu", ["device='tpu'"]),
    ("efficient_densenet", "device=tpu", ["device='tpu'"]),
    ("packed_bit_optimizers", "device=tpu", ["device='tpu'"]),
    ("variable_batch_size", "device=tpu", ["device='tpu'"]),
    ("tour", "model_name=resnet101", ["model_name='resnet101'", "resnet18 | resnet34 | resnet50"]),
    ("tour", "stem=mnist", ["stem='mnist'", "cifar | imagenet"]),
    ("optorch", "sc_model=...", ["sc_model='...'", "resnet18 | resnet34 | resnet50"]),
    ("optorch", "peer_model=vgg", ["peer_model='vgg'", "autoencoder | resnet18"]),
    ("packed_bit_optimizers", "acc_model=vgg", ["acc_model='vgg'", "mlp | resnet18"]),
    ("packed_bit_optimizers", "speed_model=vgg", ["speed_model='vgg'", "task | resnet18"]),
    ("calcgraph", "peer_model=vgg", ["peer_model='vgg'", "mlp | cnn | resnet18"]),
    ("advisor", 'models=["nosuch"]', ["models=['nosuch']", "'nosuch'", "resnet50 | densenet_bc_100"]),
    ("calcgraph", 'models=["mlp", "nosuch"]', ["'nosuch'", "mlp | cnn | resnet18"]),
    ("calcgraph", 'zoo_models=["nosuch"]', ["zoo_models=['nosuch']", "'nosuch'", "transformer encoder"]),
    ("calcgraph", "zoo_models=lstm", ["zoo_models='lstm'", "list"]),
    ("calcgraph", "data_source=imagenet", ["data_source='imagenet'", "auto | mnist | digits | synthetic"]),
    ("calcgraph", 'parallel_modes=["pmap"]', ["'pmap'", "loop | vmap"]),
    ("calcgraph", 'peers=["deepspeed"]', ["'deepspeed'", "accelerate | lightning-power | lightning-binsearch"]),
    ("optorch", "fig9_dataset=imagenet", ["fig9_dataset='imagenet'", "cifar10 | mnist | digits | synthetic"]),
    ("optorch", 'fig10_models=["vgg"]', ["'vgg'", "resnet18 | resnet34 | resnet50"]),
    ("optorch", 'floor_stems=["mnist"]', ["'mnist'", "cifar | imagenet"]),
    ("optorch", "sbs_weights=[1.0]", ["sbs_weights=[1.0]", "10 values", "1"]),
    ("packed_bit_optimizers", "tf_d_model=100", ["tf_d_model=100", "multiple of 64"]),
    ("packed_bit_optimizers", 'acc_formats=["fp7+99"]', ["acc_formats=['fp7+99']", "'fp7+99'", "fp16+0..13"]),
    ("packed_bit_optimizers", 'mem_formats=["fp16+14"]', ["'fp16+14'", "bf16+0..16"]),
    ("packed_bit_optimizers", 'tp_configs=["fp32+8"]', ["'fp32+8'"]),
    ("packed_bit_optimizers", 'peer_methods=["nosuch"]', ["'nosuch'", "torch fp32"]),
    ("packed_bit_optimizers", "optimizer=adam", ["optimizer='adam'", "sgd | adamw"]),
    ("packed_bit_optimizers", "acc_dataset=mnist", ["acc_dataset='mnist'", "digits | cifar10"]),
    ("packed_bit_optimizers", "fp16_on_slow_cpu=fp32", ["fp16_on_slow_cpu='fp32'", "bf16 | fp16"]),
    ("efficient_densenet", 'memory_forms=["nosuch"]', ["'nosuch'", "luatorch | naive"]),
    ("efficient_densenet", 'time_forms=["nosuch"]', ["'nosuch'", "checkpoint"]),
    ("variable_batch_size", "layer_statistic=mean", ["layer_statistic='mean'", "median | min"]),
    ("variable_batch_size", 'networks=["vgg16"]', ["'vgg16'", "googlenet"]),
])
def test_a_value_outside_the_declared_choices_is_refused_before_any_kernel(tmp_path, capsys, fake, notebook, arg,
                                                                        shown):
    err = _refused(tmp_path, capsys, fake, notebook, "-p", arg)
    assert f"-p for notebook {notebook!r}" in err, err
    for text in shown:
        assert text in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("notebook, args", [
    ("advisor", ['models=["resnet50", "mlp"]', "device=cpu"]),
    ("tour", ["device=cuda:1", "model_name=resnet50", "stem=imagenet"]),
    ("calcgraph", ['zoo_models=["lstm", "embedding + sdpa"]', 'peers=[]', "data_source=digits"]),
    ("optorch", ["sbs_weights=[0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]", "device=auto"]),
    ("packed_bit_optimizers", ['acc_formats=["fp16+13 SR", "bf16+16", "fp8+4", "amp"]', "tf_d_model=192",
                               'peer_methods=["all"]']),
    ("variable_batch_size", ["layer_statistic=min", 'networks=["resnet50"]']),
])
def test_values_among_the_declared_choices_still_run(tmp_path, fake, notebook, args):
    assert run_cli(NOTEBOOKS, tmp_path / "r", notebook, "--profile", "smoke",
                   *[a for arg in args for a in ("-p", arg)]) == 0
    assert len(fake.calls) == 1


@pytest.mark.parametrize("notebook", ["advisor", "tour"])
def test_an_input_tensor_larger_than_the_machine_is_refused_before_any_kernel(tmp_path, capsys, fake, monkeypatch,
                                                                             notebook):
    monkeypatch.setattr(declarations, "machine_memory", lambda: 64 * 2**30)
    err = _refused(tmp_path, capsys, fake, notebook, "-p", "batch_size=4096", "-p", "image_size=1024")
    assert f"-p for notebook {notebook!r}" in err and "batch_size=4096" in err and "image_size=1024" in err
    assert "51.5 GB" in err and "68.7 GB" in err, err
    # either alone is within its range and fits: the product is what is refused
    assert run_cli(NOTEBOOKS, tmp_path / "r", notebook, "--profile", "smoke", "-p", "batch_size=4096") == 0
    assert run_cli(NOTEBOOKS, tmp_path / "r", notebook, "--profile", "smoke", "-p", "image_size=1024") == 0


@pytest.mark.parametrize("kind", ["folder", pytest.param("fifo", marks=needs_fifo)])
def test_a_build_lock_that_is_a_folder_or_a_pipe_is_refused_before_any_notebook_runs(tmp_path, capsys, monkeypatch,
                                                                                   kind):
    fake = use_fake(monkeypatch)
    notebooks = make_notebooks(tmp_path)
    out = tmp_path / "r"
    out.mkdir()
    lock = out / ".lock"
    lock.mkdir() if kind == "folder" else os.mkfifo(lock)
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 2
    assert not fake.calls
    err = capsys.readouterr().err
    assert f"{lock} is not a plain file" in err
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing made


@pytest.mark.parametrize("name", sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))
def test_every_default_and_profile_lies_within_its_own_declarations(monkeypatch, name):
    from workbench.report import PROFILES
    from workbench.report.parameters import coerce, notebook_parameters
    from workbench.report.runner import _plan

    monkeypatch.setattr(declarations, "machine_memory", lambda: 8 * 2**30)  # a small laptop
    for parameter, d in notebook_parameters(NOTEBOOKS / f"{name}.ipynb").items():
        if d.choices or d.multiple or d.length or d.bounds:
            coerce(parameter, d.default, d, f"{name}: the default of")
    for profile in PROFILES:
        assert len(_plan([name], profile, {}, NOTEBOOKS)) == 1


@pytest.mark.parametrize("comment, problem", [
    ("choices: ", "declares no choices"),
    ("choices: a | | b", "an empty choice"),
    ("choices: cuda:9..1", "wrong way round"),
    ("multiple of: x", "no valid 'multiple of: N'"),
    ("multiple of: 0", "no valid 'multiple of: N'"),
    ("length: 3..1", "no valid length"),
    ("length: many", "no valid length"),
    ("input: batch_size x 3", "no valid input"),
    ("input: nosuch x 3 bytes", "its input names nosuch"),
])
def test_a_malformed_declaration_is_refused_naming_the_parameter(tmp_path, monkeypatch, comment, problem):
    from probe_cases import write_notebook

    from workbench.report import UsageError, build_reports

    fake = use_fake(monkeypatch)
    notebooks = make_notebooks(tmp_path)
    write_notebook(notebooks, "declares", f"batch_size = 4\nlabel = 'a'  # {comment}\n")
    with pytest.raises(UsageError, match=r"declares\.ipynb: parameter label: ") as refused:
        build_reports(["declares"], profile="smoke", out_dir=tmp_path / "r", notebooks=notebooks, progress=False)
    assert problem in str(refused.value) and not fake.calls
