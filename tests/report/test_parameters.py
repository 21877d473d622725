"""A notebook's parameters: ranges declared beside the defaults, values typed and ranged before any kernel
starts, messages that name the value, profiles that set a key twice."""

import pytest
from runner_cases import run_cli, write_notebook

from workbench.report import UsageError, build_reports, notebook_parameters
from workbench.report.parameters import numeric

RANGED = (
    "batch_size = 4      # range: 1..4096; images per step\n"
    "lr = 0.01           # range: 1e-06..10\n"
    "sizes = [1, 8]      # range: 1..65536\n"
    "models = ['mlp']    # of mlp, cnn\n"
    "note = 'a = b'      # a comment holding '=': papermill's reader skips this line\n"
    "value = 1           # range: -5..5\n"
)


@pytest.fixture
def ranged(notebooks):
    write_notebook(notebooks, "ranged", RANGED)
    return notebooks


def test_the_range_comment_is_read_beside_the_default(ranged):
    declared = notebook_parameters(ranged / "ranged.ipynb")
    assert declared["batch_size"].bounds == (1, 4096) and declared["batch_size"].default == 4
    assert declared["lr"].bounds == (1e-06, 10) and declared["lr"].bounds_text == "1e-06..10"
    assert declared["sizes"].bounds == (1, 65536) and declared["value"].bounds == (-5, 5)
    assert declared["models"].bounds is None and declared["note"].default == "a = b"
    assert declared["batch_size"].comment == "range: 1..4096; images per step"
    assert numeric(4) and numeric([1.0, 2]) and not numeric(True) and not numeric([]) and not numeric(["a"])


@pytest.mark.parametrize("arg,message", [
    ("batch_size=0", "-p for notebook 'ranged': batch_size=0 is out of range 1..4096"),
    ("batch_size=-3", "batch_size=-3 is out of range 1..4096"),
    ("batch_size=100000000000", "batch_size=100000000000 is out of range 1..4096"),
    ("lr=0", "lr=0.0 is out of range 1e-06..10"),
    ("value=-6", "value=-6 is out of range -5..5"),
    ("sizes=[1, 0]", "sizes=[1, 0] is out of range: each element must lie in 1..65536, 0 does not"),
    ("models=mlp", "models='mlp' is not a Python list literal; e.g. -p 'models=['mlp']'"),
])
def test_out_of_range_values_are_refused_before_any_kernel_starts(ranged, tmp_path, fake, capsys, arg, message):
    assert run_cli(ranged, tmp_path / "r", "ranged", "--profile", "smoke", "-p", arg) == 2
    err = capsys.readouterr().err
    assert message in err and "object at 0x" not in err
    assert not fake.calls and not (tmp_path / "r").exists()


def test_values_at_the_ends_of_the_range_are_allowed(ranged, tmp_path, fake):
    for arg in ("batch_size=1", "batch_size=4096", "value=5", "lr=10"):
        assert run_cli(ranged, tmp_path / "r", "ranged", "--profile", "smoke", "-p", arg) == 0
    assert [call[0]["batch_size"] for call in fake.calls[:2]] == [1, 4096]


def test_a_profile_value_out_of_range_names_the_file(ranged, tmp_path, fake):
    (ranged / "profiles" / "ranged.yaml").write_text("cpu:\n  sizes: [8, 100000]\n")
    with pytest.raises(UsageError, match=r"ranged\.yaml \(cpu\): sizes=\[8, 100000\] is out of range"):
        build_reports(["ranged"], profile="cpu", out_dir=tmp_path / "r", notebooks=ranged, progress=False)
    assert not fake.calls


@pytest.mark.parametrize("comment", ["range: 1..x", "range: 5..1", "range: 1-4096", "range: nan..1"])
def test_a_malformed_range_comment_is_refused_naming_the_parameter(notebooks, tmp_path, fake, comment):
    write_notebook(notebooks, "bad_range", f"batch_size = 4  # {comment}\n")
    with pytest.raises(UsageError, match=r"bad_range\.ipynb: parameter batch_size: the comment .* no valid range"):
        build_reports(["bad_range"], profile="smoke", out_dir=tmp_path / "r", notebooks=notebooks, progress=False)
    assert not fake.calls


@pytest.mark.parametrize("text,key,lines", [
    ("smoke:\n  value: 2\n  rate: 0.1\n  value: 3\n", "'value'", "lines 2 and 4"),
    ("smoke:\n  value: 2\ncpu:\n  value: 3\nsmoke:\n  rate: 0.1\n", "'smoke'", "lines 1 and 5"),
])
def test_a_key_given_twice_in_a_profile_file_is_refused_naming_it(notebooks, tmp_path, fake, capsys, text, key,
                                                                  lines):
    path = notebooks / "profiles" / "good.yaml"
    path.write_text(text)
    assert run_cli(notebooks, tmp_path / "r", "good", "--profile", "smoke") == 2
    err = capsys.readouterr().err
    assert str(path) in err and f"{key} is given twice ({lines})" in err
    assert not fake.calls
