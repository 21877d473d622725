"""Hostile `-p NAME=VALUE` values, round 5 (issue 43), for the repository's own notebooks: every parameter that
declares a range (`# range: LO..HI` beside its default, each element of a list) gets a value just outside it, and
a set of values of the wrong type (strings, bools, NaN, inf, hex, underscores, 64-bit overflow, unclosed lists,
nested lists, wrong lengths, non-ASCII digits). Each is refused before any kernel starts: exit status 2, one
line naming the notebook, the parameter and the value, no report folder made.

Non-ASCII digits (`batch_size=٣`, `batch_size=１`) were read as 3 and 1 (Python's int() takes any Unicode digit;
numbers are ASCII now). `optorch`'s `fig9_channels=2` lies within its declared `range: 1..3`, and the data sources
make 1 or 3 channels: it declares `choices: 1 | 3` too.
"""

from __future__ import annotations

import pytest
from probe_cases import REPO, run_cli, use_fake

from workbench.report.parameters import notebook_parameters

NOTEBOOKS = REPO / "notebooks"


def _outside(declared) -> tuple[str, str]:
    """A value just outside the declared range, as typed after `-p NAME=`, and how the error shows it."""
    low, high = declared.bounds
    whole = all(isinstance(e, int) for e in (declared.default if isinstance(declared.default, list)
                                             else [declared.default]))
    if whole:
        bad = low - 1 if low > 0 or high >= 2**32 - 1 else high + 1
    else:
        bad = low / 2 if low > 0 else high * 2 + 1
    text = str(int(bad)) if float(bad).is_integer() else repr(float(bad))  # as the error shows a number
    return (f"[{text}]", text) if isinstance(declared.default, list) else (text, f"={text}")


def _ranged():
    cases = []
    for notebook in sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")):
        for name, declared in notebook_parameters(NOTEBOOKS / f"{notebook}.ipynb").items():
            if declared.bounds and not declared.choices:
                typed, shown = _outside(declared)
                cases.append(pytest.param(notebook, name, typed, shown, id=f"{notebook}-{name}={typed}"))
    return cases


@pytest.fixture
def fake(monkeypatch):
    return use_fake(monkeypatch)


def _refused(tmp_path, capsys, fake, notebook, arg) -> str:
    capsys.readouterr()
    out = tmp_path / "r"
    assert run_cli(NOTEBOOKS, out, notebook, "--profile", "smoke", "-p", arg) == 2
    err = capsys.readouterr().err
    assert not fake.calls and not out.exists(), err
    assert f"-p for notebook {notebook!r}" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("notebook, name, typed, shown", _ranged())
def test_a_value_just_outside_a_declared_range_is_refused_before_any_kernel(tmp_path, capsys, fake, notebook, name,
                                                                           typed, shown):
    err = _refused(tmp_path, capsys, fake, notebook, f"{name}={typed}")
    assert name in err and shown in err and ("out of range" in err or "64 bits" in err), err


@pytest.mark.parametrize("notebook, arg, needles", [
    ("advisor", "batch_size=true", ["batch_size='true'", "not a whole number"]),
    ("advisor", "batch_size=null", ["batch_size='null'", "not a whole number"]),
    ("advisor", "batch_size=", ["batch_size=''", "not a whole number"]),
    ("advisor", "batch_size=[8]", ["batch_size='[8]'", "not a whole number"]),
    ("advisor", "batch_size=8_000", ["batch_size='8_000'", "not a whole number"]),
    ("advisor", "seed=99999999999999999999999", ["seed='99999999999999999999999'", "64 bits"]),
    ("advisor", "width=nan", ["width='nan'", "not a finite number"]),
    ("advisor", "width=-inf", ["width='-inf'", "not a finite number"]),
    ("advisor", "width='0.5'", ["width=", "'0.5'", "not a number"]),
    ("advisor", "width=True", ["width='True'", "not a number"]),
    ("advisor", "width=0x1p-3", ["width='0x1p-3'", "not a number"]),
    ("advisor", "packed_bits=8", ["packed_bits='8'", "not a list"]),
    ("advisor", "packed_bits=[true]", ["packed_bits='[true]'", "list literal"]),
    ("advisor", 'models=["mlp"', ["models=", "list literal"]),
    ("advisor", "models=[]", ["models=[]", "is empty"]),
    ("advisor", "models=[1]", ["models=[1]", "holds 1"]),
    ("advisor", 'models=["MLP"]', ["'MLP'", "declared choices"]),
    ("tour", "batch_size=8.0", ["batch_size='8.0'", "not a whole number"]),
    ("tour", "model_name=ResNet18", ["model_name='ResNet18'", "resnet18"]),
    ("tour", "device=cpu ", ["device='cpu '", "declared choices"]),
    ("calcgraph", "n_train=0x10", ["n_train='0x10'", "not a whole number"]),
    ("calcgraph", "lr=1e1000", ["lr='1e1000'", "not a finite number"]),
    ("calcgraph", "lr=1e-7", ["lr=1e-07", "out of range"]),
    ("calcgraph", "batch_sizes=[1,nan]", ["batch_sizes='[1,nan]'", "list literal"]),
    ("calcgraph", "batch_sizes=[1,true]", ["batch_sizes='[1,true]'", "list literal"]),
    ("calcgraph", "batch_sizes={1,2}", ["batch_sizes='{1,2}'", "not a list"]),
    ("calcgraph", "batch_sizes=[]", ["batch_sizes=[]", "is empty"]),
    ("calcgraph", "peers=null", ["peers='null'", "list literal"]),
    ("calcgraph", 'peers=["accelerate","accelerate","accelerate","accelerate"]', ["holds 4 values", "0..3"]),
    ("calcgraph", "data_source=", ["data_source=''", "declared choices"]),
    ("optorch", "sbs_weights=[0.1]", ["sbs_weights=[0.1]", "10 values"]),
    ("optorch", "sbs_weights=[0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1,0.1]", ["holds 11 values", "10 values"]),
    ("optorch", "loader_workers=[0.5]", ["loader_workers=[0.5]", "not a whole number"]),
    ("efficient_densenet", "depths=[16,40.5]", ["holds 40.5", "not a whole number"]),
    ("packed_bit_optimizers", "tf_d_model=128.5", ["tf_d_model='128.5'", "not a whole number"]),
    ("packed_bit_optimizers", "tp_numel=1e9", ["tp_numel='1e9'", "not a whole number"]),
    ("packed_bit_optimizers", 'acc_formats=["fp16+8 SR",""]', ["holds ''", "declared choices"]),
    ("variable_batch_size", 'networks=[["resnet50"]]', ["holds ['resnet50']", "declared choices"]),
    ("variable_batch_size", "networks=[]", ["networks=[]", "is empty"]),
])
def test_a_value_of_the_wrong_type_is_refused_before_any_kernel(tmp_path, capsys, fake, notebook, arg, needles):
    err = _refused(tmp_path, capsys, fake, notebook, arg)
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("arg", ["=1", "batch_size"])
def test_a_pair_without_a_name_or_an_equals_sign_is_refused_by_the_parser(tmp_path, capsys, fake, arg):
    with pytest.raises(SystemExit) as info:
        run_cli(NOTEBOOKS, tmp_path / "r", "advisor", "--profile", "smoke", "-p", arg)
    assert info.value.code == 2 and f"expected name=value, got {arg!r}" in capsys.readouterr().err
    assert not fake.calls and not (tmp_path / "r").exists()


@pytest.mark.parametrize("arg", ["interactive=True", "output_dir=/tmp"])
def test_the_runner_s_own_parameters_are_refused(tmp_path, capsys, fake, arg):
    capsys.readouterr()
    assert run_cli(NOTEBOOKS, tmp_path / "r", "advisor", "--profile", "smoke", "-p", arg) == 2
    assert "set by the report runner itself" in capsys.readouterr().err and not fake.calls


@pytest.mark.parametrize("digit", ["٣", "１"])
def test_non_ascii_digits_are_refused(tmp_path, capsys, fake, digit):
    _refused(tmp_path, capsys, fake, "advisor", f"batch_size={digit}")


def test_a_channel_count_the_data_cannot_take_is_refused_before_any_kernel(tmp_path, capsys, fake):
    """fig9_channels=2 lies within 'range: 1..3', and the data sources make 1 or 3 channels: 'choices: 1 | 3'."""
    assert "not one of the declared choices: 1 | 3" in _refused(tmp_path, capsys, fake, "optorch", "fig9_channels=2")


def test_whole_number_choices_match_those_numbers_only():
    from workbench.report.declarations import parse_choices

    choices = parse_choices("range: 1..3; choices: 1 | 3; channels", "x")
    assert [any(c.matches(v) for c in choices) for v in (1, 3, 2, 0, True, 1.0, "2")] == \
        [True, True, False, False, False, False, False]
