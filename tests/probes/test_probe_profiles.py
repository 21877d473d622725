"""Profile files and -p values from issue 35: each is refused before any kernel starts, exit status 2, naming the
file and line (or the parameter) and what is expected; on 012f1da each hung, ended in a traceback, or ran with
a value the user did not write."""

from __future__ import annotations

import os

import pytest
from probe_cases import make_notebooks, run_cli, use_fake, within, write_notebook

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")


@pytest.fixture
def notebooks(tmp_path):
    folder = make_notebooks(tmp_path)
    write_notebook(folder, "listed", "sizes = [1, 2]\nvalue = 1\nlabel = 'a'\n")
    return folder


@pytest.fixture
def fake(monkeypatch):
    return use_fake(monkeypatch)


def _refused(notebooks, tmp_path, capsys, fake, *args) -> str:
    capsys.readouterr()
    assert run_cli(notebooks, tmp_path / "r", *args) == 2
    assert not fake.calls and not (tmp_path / "r").exists()
    return capsys.readouterr().err


def _profile(notebooks, text):
    path = notebooks / "profiles" / "listed.yaml"
    path.write_text(text)
    return path


def test_an_alias_bomb_in_a_list_parameter_is_refused_naming_the_line(notebooks, tmp_path, fake, capsys):
    levels = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 4)]
    path = _profile(notebooks, "\n".join(levels) + "\nsmoke:\n  sizes: *a3\n")
    err = _refused(notebooks, tmp_path, capsys, fake, "listed", "--profile", "smoke")
    assert f"{path}, line 2: the alias *a0" in err


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "\n" + "".join("  " * (i + 2) + "-\n" for i in range(300))])
def test_a_value_nested_thousands_deep_is_refused_not_a_traceback(notebooks, tmp_path, fake, capsys, value):
    path = _profile(notebooks, f"smoke:\n  sizes: {value}\n")
    err = _refused(notebooks, tmp_path, capsys, fake, "listed", "--profile", "smoke")
    assert str(path) in err and "nested more than MAX_VALUE_DEPTH=32 levels deep" in err


def test_a_5000_digit_integer_in_a_profile_is_refused_not_a_traceback(notebooks, tmp_path, fake, capsys):
    path = _profile(notebooks, f"smoke:\n  value: {'7' * 5000}\n")
    err = _refused(notebooks, tmp_path, capsys, fake, "listed", "--profile", "smoke")
    assert f"{path}, line 2: a whole number of 5000 digits (77777" in err and "at most 30 digits" in err


@pytest.mark.parametrize("digits", [4301, 20])
def test_a_huge_whole_number_from_the_command_line_is_refused_naming_the_parameter(notebooks, tmp_path, fake,
                                                                                     capsys, digits):
    err = _refused(notebooks, tmp_path, capsys, fake, "good", "--profile", "smoke", "-p", f"value={'9' * digits}")
    assert "-p for notebook 'good': value='99999" in err and "is not a whole number in -2**63..2**63-1" in err
    assert len(err) < 600  # the value is cut, not printed whole


@pytest.mark.parametrize("text, yaml11", [("010", "8"), ("1:30", "90"), ("-010", "-8"), ("1:30.5", "90.5")])
def test_numbers_yaml_1_1_reads_otherwise_are_refused_not_run(notebooks, tmp_path, fake, capsys, text, yaml11):
    path = _profile(notebooks, f"smoke:\n  value: {text}\n")
    err = _refused(notebooks, tmp_path, capsys, fake, "listed", "--profile", "smoke")
    assert f"{path}, line 2: {text} is {yaml11} in YAML 1.1 but" in err
    _profile(notebooks, f"smoke:\n  label: '{text}'\n  value: 10\n")  # quoted, it is text; 10 is ten
    assert run_cli(notebooks, tmp_path / "r", "listed", "--profile", "smoke") == 0
    assert fake.calls[-1][0]["label"] == text and fake.calls[-1][0]["value"] == 10


@needs_fifo
def test_a_named_pipe_as_a_profile_is_refused_not_waited_on(notebooks, tmp_path, fake, capsys):
    fifo = notebooks / "profiles" / "listed.yaml"
    os.mkfifo(fifo)
    try:
        code = within(20, lambda: run_cli(notebooks, tmp_path / "r", "listed", "--profile", "smoke"))
    finally:
        try:  # release a reader stuck on the pipe (the bug under test) before failing
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert code == 2 and f"{fifo}: the profile file is a named pipe, not a plain file" in capsys.readouterr().err
    assert not fake.calls


def test_a_folder_named_like_a_profile_is_refused_naming_it(notebooks, tmp_path, fake, capsys):
    path = notebooks / "profiles" / "listed.yaml"
    path.mkdir()
    err = _refused(notebooks, tmp_path, capsys, fake, "listed", "--profile", "smoke")
    assert f"{path}: the profile file is a folder, not a plain file" in err
