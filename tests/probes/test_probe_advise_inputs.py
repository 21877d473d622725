"""Hostile inputs to `workbench advise` and to the kernel spec check (issue 43): each refused in one line that
names the option (or the file), the value and what is allowed, with exit status 2, before anything is traced.

On 00fe2f5: `--batch 2x²` said only "invalid literal for int() with base 10: '²'"; a batch whose element count
overflows gave a RuntimeError traceback; a model whose parameters are all frozen was traced, then "the input"
was blamed; a `--sample` of mismatched, empty, scalar or sparse tensors gave errors that never named
`--sample`; a kernel spec nested 100,000 deep gave a RecursionError.
"""

from __future__ import annotations

import sys

import pytest
import torch

import workbench.advisor.command as command
from workbench.cli import main
from workbench.report import UsageError
from workbench.report.runner import check_kernel_spec

MODELS = """
from torch import nn

def linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 4))

def frozen():
    model = nn.Linear(8, 4)
    for p in model.parameters():
        p.requires_grad_(False)
    return model

def no_parameters():
    return nn.Sequential(nn.Flatten(), nn.ReLU())
"""


@pytest.fixture
def advise_cli(tmp_path, monkeypatch, request):
    """`workbench advise ARGS` run in-process in tmp_path, with the user's models as a module of a name of its
    own; the advisor itself replaced by a stub that fails the test: every refusal here comes before it runs."""
    module = f"probe_models_{request.node.name.split('[')[0][5:]}_{abs(hash(request.node.name)) % 10**6}"
    (tmp_path / f"{module}.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def traced(*args, **kwargs):
        raise AssertionError("the advisor ran (traces) before the input was refused")

    monkeypatch.setattr(command, "advise", traced)

    def run(factory: str, *args: str) -> int:
        return main(["advise", f"{module}:{factory}", "--budget", "1MB", *args])

    return run


def refusal(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ --batch and --targets


@pytest.mark.parametrize("value", ["2x²", "²x8", "2x٣", "2x８"])
def test_a_batch_of_non_ascii_digits_is_refused_naming_batch(advise_cli, capsys, value):
    """'²'.isdigit() is True, then int('²') raised "invalid literal for int()", naming neither --batch nor
    the value; '٣' (Arabic-Indic three) was taken for 3."""
    assert advise_cli("linear", "--batch", value) == 2
    err = refusal(capsys)
    assert f"--batch {value!r}" in err and "sizes >= 1 joined by 'x'" in err, err


def test_targets_of_non_ascii_digits_are_refused_naming_targets(advise_cli, capsys):
    assert advise_cli("linear", "--batch", "2x8", "--targets", "2x²") == 2
    err = refusal(capsys)
    assert "--targets '2x²'" in err and "joined by 'x'" in err, err


@pytest.mark.parametrize("option, value", [
    ("--batch", f"{2**20}x{2**62}"),
    ("--batch", f"2x{2**61}"),
    ("--batch", f"{2**39}x{2**39}x{2**39}"),
    ("--targets", f"2x{2**62}x{2**62}"),
])
def test_a_batch_whose_element_count_overflows_is_refused_naming_the_option(advise_cli, capsys, option, value):
    """torch.empty(..., device='meta') raised 'Storage size calculation overflowed' in a traceback."""
    args = ["--batch", value] if option == "--batch" else ["--batch", "2x8", "--targets", value]
    assert advise_cli("linear", *args) == 2
    err = refusal(capsys)
    assert f"{option} {value!r}" in err and "elements" in err and "at most" in err, err


def test_a_batch_size_past_what_a_plan_sizes_is_refused_naming_batch(advise_cli, capsys):
    """48 plans were traced, then calcgraph's "batch_size must be at most MAX_BATCH=2**40" named no option."""
    assert advise_cli("linear", "--batch", f"{2**41}x8") == 2
    err = refusal(capsys)
    assert f"--batch '{2**41}x8'" in err and "at most 2**40" in err, err


# ------------------------------------------------------------------ the model


@pytest.mark.parametrize("factory", ["frozen", "no_parameters"])
def test_a_model_with_nothing_to_train_is_refused_naming_the_model(advise_cli, capsys, factory):
    """Every plan was traced, then "the training program refused the input [2, 8] ... element 0 of tensors
    does not require grad" blamed the input."""
    assert advise_cli(factory, "--batch", "2x8") == 2
    err = refusal(capsys)
    assert f":{factory}'" in err and "requires_grad" in err and "the input" not in err, err


@pytest.mark.parametrize("args, named", [(["--margin", "nan"], "--margin nan"),
                                         (["--device", "tpu"], "--device 'tpu'")])
def test_a_bad_option_is_named_before_a_model_with_nothing_to_train(advise_cli, capsys, args, named):
    """The check of the model (built once on the meta device) comes after the options' own checks."""
    assert advise_cli("no_parameters", "--batch", "2x8", *args) == 2
    err = refusal(capsys)
    assert named in err and "nothing to train" not in err, err


# ------------------------------------------------------------------ --sample


def _save(path, inputs, targets) -> str:
    torch.save((inputs, targets), path)
    return str(path.name)


@pytest.mark.parametrize("case, inputs, targets, allowed", [
    ("other batch sizes", torch.zeros(2, 8), torch.zeros(3, dtype=torch.long), "the same batch size"),
    ("empty batch", torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), "batch size >= 1"),
    ("scalars", torch.tensor(1.0), torch.tensor(1), "batch first"),
    ("sparse inputs", torch.zeros(2, 8).to_sparse(), torch.zeros(2, dtype=torch.long), "dense"),
    ("complex inputs", torch.zeros(2, 8, dtype=torch.complex64), torch.zeros(2, dtype=torch.long), "dtype"),
])
def test_a_sample_that_cannot_be_a_batch_is_refused_naming_sample(advise_cli, capsys, tmp_path, case, inputs,
                                                                   targets, allowed):
    """These reached the advisor, whose errors ("inputs and targets need the same batch size >= 1", "Cannot
    access storage of SparseTensorImpl" after 48 traces) never named --sample or its file."""
    name = _save(tmp_path / "batch.pt", inputs, targets)
    assert advise_cli("linear", "--sample", name) == 2
    err = refusal(capsys)
    assert f"--sample {name!r}" in err and allowed in err, (case, err)


@pytest.mark.parametrize("extra", [["--batch", "2x8"], ["--targets", "2"]])
def test_a_sample_given_with_batch_or_targets_is_refused_naming_sample(advise_cli, capsys, tmp_path, extra):
    name = _save(tmp_path / "batch.pt", torch.zeros(2, 8), torch.zeros(2, dtype=torch.long))
    assert advise_cli("linear", "--sample", name, *extra) == 2
    err = refusal(capsys)
    assert f"--sample {name!r}" in err and extra[0] in err, err


def test_the_model_refusing_a_sample_names_sample(advise_cli, capsys, tmp_path, monkeypatch):
    """Long inputs to a float model: "layer '1' (Linear) refused the input [2, 8] ..." said nothing of the file
    the input came from (the advisor's own message, stubbed here: the real one comes after its traces)."""
    def refuses(*args, **kwargs):
        raise ValueError("layer '1' (Linear) refused the input [2, 8]: RuntimeError: needs one dtype")

    monkeypatch.setattr(command, "advise", refuses)
    name = _save(tmp_path / "ids.pt", torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert advise_cli("linear", "--sample", name) == 2
    err = refusal(capsys)
    assert "refused the input [2, 8]" in err and f"--sample {name!r}" in err, err


def test_a_sample_that_is_not_a_file_is_refused_naming_sample(advise_cli, capsys):
    assert advise_cli("linear", "--sample", "nosuch.pt") == 2
    err = refusal(capsys)
    assert "--sample 'nosuch.pt'" in err and "torch.save((inputs, targets))" in err, err


# ------------------------------------------------------------------ the kernel spec


@pytest.mark.parametrize("opening, closing", [("[", "]"), ('{"a": ', "}")])
def test_a_kernel_spec_nested_deep_is_a_usage_error_naming_the_file(tmp_path, opening, closing):
    """json.loads raised RecursionError out of check_kernel_spec (and `workbench kernel install`)."""
    spec = tmp_path / "kernel.json"
    spec.write_text('{"argv": ' + opening * 100_000 + "1" + closing * 100_000 + ', "display_name": "x"}')
    with pytest.raises(UsageError) as info:
        check_kernel_spec(spec)
    message = str(info.value)
    assert str(spec) in message and "\n" not in message and "nested" in message, message
