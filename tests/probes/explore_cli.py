"""Exploration probes, family `cli`: `workbench` command-line arguments (see explore.py). Every bad argument must
end in exit status 2 with a message naming it, before any notebook runs; good ones must run."""

from __future__ import annotations

import os

from explore import cases, cli, cli_refusal, cli_works, probe

NINES = "9" * 4301

# -p NAME=VALUE for notebook `good` (value: int, rate: float, flag: bool, label: str) -> the text a refusal names
BAD_P = {
    "int from text": ("value=abc", "value='abc'"), "int from a fraction": ("value=1.5", "value='1.5'"),
    "int empty": ("value=", "value=''"), "int in e-notation": ("value=1e3", "value='1e3'"),
    "int in hex": ("value=0x10", "value='0x10'"), "int sign only": ("value=+", "value='+'"),
    "int twice signed": ("value=--1", "value='--1'"), "int with a space inside": ("value=1 2", "value='1 2'"),
    "int of 20 digits": ("value=" + "9" * 20, "value='99999999999999999999'"),
    "int of 4301 digits": ("value=" + NINES, "value='9999"), "int past int64": ("value=9223372036854775808", "2**63"),
    "int superscript": ("value=²", "value='²'"), "int as a list": ("value=[1]", "value='[1]'"),
    "float nan": ("rate=nan", "rate='nan'"), "float inf": ("rate=inf", "rate='inf'"),
    "float -inf": ("rate=-inf", "rate='-inf'"), "float overflow": ("rate=1e309", "rate='1e309'"),
    "float text": ("rate=fast", "rate='fast'"), "float empty": ("rate=", "rate=''"),
    "float hex": ("rate=0x1p3", "rate='0x1p3'"), "float 5000 digits": ("rate=" + "9" * 5000, "rate='9999"),
    "bool yes": ("flag=yes", "flag='yes'"), "bool 1": ("flag=1", "flag='1'"), "bool on": ("flag=on", "flag='on'"),
    "bool empty": ("flag=", "flag=''"), "bool none": ("flag=None", "flag='None'"),
    "undeclared": ("nope=1", "nope"), "no name": ("=1", "'=1'"), "no equals": ("value", "'value'"),
    "name starting with a digit": ("1value=2", "'1value=2'"), "cyrillic e in the name": ("valuе=1", "valuе"),
    "reserved interactive": ("interactive=True", "interactive"),
    "reserved output_dir": ("output_dir=/tmp", "output_dir"),
    "name with a dash": ("my-value=1", "'my-value=1'"), "name with a space": ("val ue=1", "'val ue=1'"),
}
GOOD_P = {
    "int with spaces around": "value= 3 ", "int plus sign": "value=+3", "int minus zero": "value=-0",
    "int leading zeros": "value=007", "int at int64 max": "value=9223372036854775807",
    "float underscore": "rate=1_0", "float e-notation": "rate=1e-3", "float whole": "rate=3",
    "bool TRUE": "flag=TRUE", "bool false": "flag=false", "str empty": "label=", "str with NUL": "label=a\0b",
    "str of 100 KB": "label=" + "x" * 100_000, "str looking like a list": "label=[1, 2]",
    "str with quotes": "label=it's \"quoted\"", "str unicode": "label=名前 ✓",
}
BAD_LIST = {  # for notebook `listed`: sizes = [1, 2] (range 1..100), names = ['a'] (no range)
    "element below range": ("sizes=[0]", "0 does not"), "element above range": ("sizes=[101]", "101 does not"),
    "empty": ("sizes=[]", "sizes=[] is empty"), "nested": ("sizes=[[1]]", "nested list [1]"),
    "fraction": ("sizes=[1.5]", "1.5, which is not a whole number"), "text element": ("sizes=['a']", "'a'"),
    "not a list": ("sizes=1", "sizes='1'"), "bool element": ("sizes=[True]", "True"),
    "None element": ("sizes=[None]", "None"), "dict": ("sizes={'a': 1}", "sizes=\"{'a': 1}\""),
    "call": ("names=__import__('os')", "names="), "lambda": ("names=[lambda: 1]", "names="),
    "nested 40 deep": ("names=" + "[" * 40 + "]" * 40, "MAX_VALUE_DEPTH"),
    "nested 300 deep": ("names=" + "[" * 300 + "]" * 300, "names='[[[["),
    "nested 100000 deep": ("names=" + "[" * 100_000 + "]" * 100_000, "names='[[[["),
    "huge int element": ("sizes=[" + NINES + "]", "sizes="), "inf element": ("sizes=[1e999]", "inf"),
    "unclosed": ("names=['a'", "names=\"['a'\""), "a set": ("names={'a'}", "names=\"{'a'}\""),
}
GOOD_LIST = {"ends of the range": "sizes=[1, 100]", "a tuple": "sizes=(1, 2)", "long list": "sizes=" + str(
    [1] * 10000), "mixed names": "names=['a', 1]", "empty names": "names=[]"}
NAMES = {  # notebook names on the command line -> needle
    "parent folder": ("../good", "../good"), "slash": ("a/b", "a/b"), "empty": ("", "''"),
    "blank": ("   ", "'   '"), "semicolon": ("good;rm", "good;rm"), "unicode": ("góod", "góod"),
    "NUL": ("good\0", "good"), "long": ("x" * 5000, "xxxx"), "upper case": ("GOOD", "GOOD"),
    "with suffix": ("good.ipynb", "good.ipynb"), "dash": ("-", "notebook(s) -;"), "dot": (".", "'.'"),
}
OPTIONS = {  # other arguments -> needle
    "profile upper case": (["--profile", "SMOKE"], "'SMOKE'"), "profile empty": (["--profile", ""], "''"),
    "profile unknown": (["--profile", "paper2"], "'paper2'"), "profile missing value": (["--profile"], "--profile"),
    "-p missing value": (["-p"], "-p"), "workers 0": (["--workers", "0"], "'0'"),
    "workers negative": (["--workers", "-1"], "'-1'"), "workers 257": (["--workers", "257"], "'257'"),
    "workers fraction": (["--workers", "1.5"], "'1.5'"), "workers text": (["--workers", "abc"], "'abc'"),
    "workers empty": (["--workers", ""], "''"), "workers e-notation": (["--workers", "1e2"], "'1e2'"),
    "workers huge": (["--workers", NINES], "9999"), "workers and scheduler": (
        ["--workers", "2", "--scheduler", "tcp://127.0.0.1:1"], "not allowed with"),
    "scheduler empty": (["--scheduler", ""], "scheduler=''"), "scheduler scheme only": (["--scheduler", "tcp://"],
                                                                                         "'tcp://'"),
    "scheduler no port": (["--scheduler", "tcp://127.0.0.1"], "'tcp://127.0.0.1'"),
    "scheduler no host": (["--scheduler", "tcp://:8786"], "'tcp://:8786'"),
    "scheduler port 0": (["--scheduler", "tcp://127.0.0.1:0"], "'tcp://127.0.0.1:0'"),
    "scheduler port 70000": (["--scheduler", "tcp://127.0.0.1:70000"], "70000"),
    "scheduler inproc": (["--scheduler", "inproc://x"], "'inproc'"), "scheduler ucx": (["--scheduler", "ucx://x:1"],
                                                                                       "'ucx'"),
    "scheduler unknown scheme": (["--scheduler", "foo://x:1"], "'foo'"),
    "scheduler nothing listening": (["--scheduler", "tcp://127.0.0.1:9"], "127.0.0.1:9"),
    "scheduler ws nothing listening": (["--scheduler", "ws://127.0.0.1:9"], "127.0.0.1:9"),
    "scheduler NUL": (["--scheduler", "tcp://127.0.0.1\0:1"], "'tcp://127.0.0.1\\x00:1'"),
    "scheduler huge port": (["--scheduler", "tcp://127.0.0.1:" + NINES], "scheduler="),
}
COMMANDS = {  # whole command lines -> needle
    "no command": ([], "COMMAND"), "unknown command": (["nope"], "'nope'"), "kernel without action": (["kernel"],
                                                                                                      "ACTION"),
    "kernel unknown action": (["kernel", "nope"], "'nope'"), "list with an extra": (["list", "extra"], "extra"),
    "env with an option": (["env", "--json"], "--json"), "report unknown option": (["report", "--fast"], "--fast"),
    "advise without arguments": (["advise"], "--batch"), "advise bad budget": (
        ["advise", "torch.nn:Identity", "--batch", "2x3", "--budget", "lots"], "'lots'"),
    "advise bad batch": (["advise", "torch.nn:Identity", "--batch", "2xx3", "--budget", "1GB"], "2xx3"),
    "advise bad margin": (["advise", "torch.nn:Identity", "--batch", "2x3", "--budget", "1GB", "--margin", "nan"],
                          "nan"),
    "advise bad module": (["advise", "no_such_module_x:f", "--batch", "2x3", "--budget", "1GB"], "no_such_module_x"),
    "advise no colon": (["advise", "nocolon", "--batch", "2x3", "--budget", "1GB"], "nocolon"),
    "advise bad device": (["advise", "torch.nn:Identity", "--batch", "2x3", "--budget", "1GB", "--device", "tpu"],
                          "tpu"),
}


@cases("cli", "-p refused", BAD_P)
def bad_p(sb, case):
    arg, needle = case
    sb.notebooks()
    return cli_refusal(sb.report("good", "--profile", "smoke", "-p", arg), needle)


@cases("cli", "-p accepted", GOOD_P)
def good_p(sb, arg):
    sb.notebooks()
    return cli_works(sb.report("good", "--profile", "smoke", "-p", arg))


@cases("cli", "-p list refused", BAD_LIST)
def bad_list(sb, case):
    arg, needle = case
    sb.notebooks()
    return cli_refusal(sb.report("listed", "--profile", "smoke", "-p", arg), needle)


@cases("cli", "-p list accepted", GOOD_LIST)
def good_list(sb, arg):
    sb.notebooks()
    return cli_works(sb.report("listed", "--profile", "smoke", "-p", arg))


@probe("cli", "-p given twice")
def twice(sb):
    sb.notebooks()
    return cli_refusal(sb.report("good", "--profile", "smoke", "-p", "value=1", "-p", "value=2"), "-p value")


@cases("cli", "notebook name refused", NAMES)
def names(sb, case):
    name, needle = case
    sb.notebooks()
    return cli_refusal(sb.report(name, "--profile", "smoke"), needle)


@probe("cli", "notebook named twice runs once")
def named_twice(sb):
    sb.notebooks()
    return cli_works(sb.report("good", "good", "--profile", "smoke"))


@cases("cli", "option refused", OPTIONS, timeout=45)
def options(sb, case):
    args, needle = case
    sb.notebooks()
    return cli_refusal(sb.report("good", "--profile", "smoke", *args) if args[0] != "--profile" else
                       sb.report("good", *args), needle)


@cases("cli", "command refused", COMMANDS)
def commands(sb, case):
    argv, needle = case
    return cli_refusal(cli(argv), needle)


def _out(sb, kind):
    target = sb.root / "target"
    if kind == "a file":
        target.write_text("mine")
        sb.keep(target)
    elif kind == "a named pipe":
        os.mkfifo(target)
    elif kind == "inside a file":
        (sb.root / "file").write_text("mine")
        sb.keep(sb.root / "file")
        target = sb.root / "file" / "sub"
    elif kind == "a dangling link":
        target.symlink_to(sb.root / "nowhere" / "deeper")
    elif kind == "a link loop":
        target.symlink_to(target)
    elif kind == "a name too long":
        target = sb.root / ("x" * 300)
    elif kind == "a NUL byte":
        target = sb.root / "a\0b"
    elif kind == "the device null":
        target = "/dev/null"
    return str(target)


OUTS = ["a file", "a named pipe", "inside a file", "a dangling link", "a link loop", "a name too long", "a NUL byte",
        "the device null"]


@cases("cli", "--out refused", {k: k for k in OUTS})
def bad_out(sb, kind):
    sb.notebooks()
    target = _out(sb, kind)
    outcome = cli(["report", "--notebooks", str(sb.root / "notebooks"), "--out", target, "good", "--profile", "smoke"])
    return cli_refusal(outcome, target.split("\0")[0][-40:])


@cases("cli", "--out empty refused", {"empty": "", "blank": "  "})
def empty_out(sb, text):
    sb.notebooks()
    return cli_refusal(cli(["report", "--out", text, "good"]), repr(text))


def _notebooks(sb, kind):
    folder = sb.notebooks()
    if kind == "missing":
        return str(sb.root / "nope")
    if kind == "a file":
        (sb.root / "file").write_text("x")
        return str(sb.root / "file")
    if kind == "empty":
        (sb.root / "empty").mkdir()
        return str(sb.root / "empty")
    if kind == "notebook not JSON":
        (folder / "good.ipynb").write_text("{not json")
    elif kind == "notebook a named pipe":
        (folder / "good.ipynb").unlink()
        os.mkfifo(folder / "good.ipynb")
    elif kind == "notebook a folder":
        (folder / "good.ipynb").unlink()
        (folder / "good.ipynb").mkdir()
    elif kind == "parameters cell not Python":
        from probe_cases import write_notebook
        write_notebook(folder, "good", "value = (\n")
    elif kind == "parameters cell without output_dir":
        import nbformat
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("value = 1", metadata={"tags": ["parameters"]})]
        nbformat.write(nb, folder / "good.ipynb")
    elif kind == "range comment malformed":
        from probe_cases import write_notebook
        write_notebook(folder, "good", "value = 1  # range: 5..1\n")
    elif kind == "notebook JSON nested deep":
        (folder / "good.ipynb").write_text("[" * 100000 + "]" * 100000)
    elif kind == "notebook a link loop":
        (folder / "good.ipynb").unlink()
        (folder / "good.ipynb").symlink_to(folder / "good.ipynb")
    return str(folder)


NOTEBOOKS = {"missing": "nope", "a file": "file", "empty": "holds no notebooks", "notebook not JSON": "good.ipynb",
             "notebook a named pipe": "good", "notebook a folder": "good", "parameters cell not Python": "good.ipynb",
             "parameters cell without output_dir": "output_dir", "range comment malformed": "range",
             "notebook JSON nested deep": "good.ipynb", "notebook a link loop": "good"}


@cases("cli", "--notebooks refused", {k: k for k in NOTEBOOKS})
def bad_notebooks(sb, kind):
    folder = _notebooks(sb, kind)
    return cli_refusal(cli(["report", "--notebooks", folder, "--out", str(sb.root / "reports"), "good", "--profile",
                            "smoke"]), NOTEBOOKS[kind])
