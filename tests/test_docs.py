"""Docs that cannot rot: every `semoe ...` command in the README's and docs/' code blocks names a
subcommand and flags the real parser has (parsed only, nothing runs), every relative link and every
repository path they quote exists, and the README's table of supported architectures is the code's."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex

import pytest

from helpers.procs import ROOT

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# a quoted path of the repository: a top-level folder of the tree, then a file or folder under it
TOP = ("semoe", "inference", "storage", "mpress", "tools", "tests", "bench", "docs", ".ci")
QUOTED_PATH = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)`")
# how a command line starts the command line tool in the docs
SEMOE = re.compile(r"(?:^|[\s;&|(])(?:bash tools/run\.sh semoe|\.venv/bin/semoe|semoe)\s+([a-z].*)")


def doc_files() -> list[str]:
    """The README and every page of docs/."""
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert len(pages) >= 10, pages
    return [os.path.join(ROOT, "README.md"), *pages]


def _command_lines(text: str) -> list[str]:
    """The `semoe ...` command lines in `text`'s fenced code blocks, continuation lines joined."""
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines = joined.splitlines()
        i = 0
        while i < len(lines):  # a synopsis wraps onto lines indented under the command
            line = lines[i]
            while i + 1 < len(lines) and lines[i + 1].startswith(" ") and line.lstrip().startswith("semoe "):
                i += 1
                line += " " + lines[i].strip()
            m = SEMOE.search(line.split(" #")[0])
            if m:
                out.append(" ".join(m.group(1).split()))
            i += 1
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def command_problems(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """What in one command line (after `semoe`) the parser does not have: its subcommands (down to the
    leaf, `store import`) and every --flag it names, the synopsis' `[--a | --b]` alternatives included."""
    try:
        words = shlex.split(command.replace("|", " ").replace("[", " ").replace("]", " "))
    except ValueError:
        words = command.split()
    top_flags = _flags(parser)
    words = [w for w in words if w not in top_flags]  # `semoe -v store ...`
    problems, here, path = [], parser, "semoe"
    while (subs := _subparsers(here)) and words:
        name = words.pop(0)
        if name not in subs:
            return [f"`{path} {name}`: no such subcommand (it has {', '.join(sorted(subs))})"]
        here, path = subs[name], f"{path} {name}"
    have = _flags(here) | top_flags
    for w in words:
        flag = w.split("=", 1)[0].rstrip(",.;")
        if re.fullmatch(r"--?[A-Za-z][\w-]*", flag) and flag not in have:
            problems.append(f"`{path}` has no flag {flag}")
    return problems


def _parser() -> argparse.ArgumentParser:
    from tools.cli import build_parser

    return build_parser()


def test_every_semoe_command_in_the_docs_has_its_subcommand_and_flags():
    parser = _parser()
    problems, seen = [], 0
    for path in doc_files():
        for command in _command_lines(open(path, encoding="utf-8").read()):
            seen += 1
            problems += [f"{os.path.relpath(path, ROOT)}: {p}" for p in command_problems(command, parser)]
    assert seen >= 30, seen  # the pages show commands; a change to the regex that finds none fails here
    assert problems == []


@pytest.mark.parametrize("command, problem", [
    ("generate --model M --max-new-token 8", "`semoe generate` has no flag --max-new-token"),
    ("store imprt HF STORE", "`semoe store imprt`: no such subcommand"),
    ("serve --model M [--lean | --resident] [--kv-memroy SIZE]", "`semoe serve` has no flag --kv-memroy"),
])
def test_the_command_check_catches_a_misspelt_flag_or_subcommand(command, problem):
    got = command_problems(command, _parser())
    assert len(got) == 1 and got[0].startswith(problem), got


def test_the_command_check_reads_commands_out_of_code_blocks():
    text = ("Run\n\n```bash\nsemoe generate --model M \\\n    --greedy  # a comment --nope\n"
            "bash tools/run.sh semoe store verify S\nls -l\n```\n\nnot `semoe train --x` outside a block\n")
    assert _command_lines(text) == ["generate --model M --greedy", "store verify S"]


def link_problems(path: str) -> list[str]:
    """Relative links and quoted repository paths in `path` that name nothing in the tree."""
    text = open(path, encoding="utf-8").read()
    here = os.path.dirname(path)
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(here, file))):
            out.append(f"{os.path.relpath(path, ROOT)}: link {target} resolves to nothing")
    for quoted in QUOTED_PATH.findall(text):
        if any(c in quoted for c in "*{<") or quoted.endswith("/..."):
            continue
        if not os.path.exists(os.path.join(ROOT, quoted.rstrip("/"))):
            out.append(f"{os.path.relpath(path, ROOT)}: `{quoted}` is no path of the repository")
    return out


def test_every_relative_link_and_quoted_path_in_the_docs_resolves():
    assert sum(len(LINK.findall(open(p, encoding="utf-8").read())) for p in doc_files()) >= 20
    problems = [p for path in doc_files() for p in link_problems(path)]
    assert problems == []


def test_the_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[ok](there.md#part) [web](https://example.org) [gone](missing.md) `semoe/nowhere.py`\n")
    assert link_problems(str(page)) == [f"{os.path.relpath(page, ROOT)}: link missing.md resolves to nothing",
                                        f"{os.path.relpath(page, ROOT)}: `semoe/nowhere.py` is no path of the "
                                        "repository"]


def test_the_readme_lists_every_page_of_docs():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    linked = {os.path.normpath(t.split("#")[0]) for t in LINK.findall(readme)}
    pages = {os.path.relpath(p, ROOT) for p in doc_files()[1:]}
    assert pages - linked == set()


def test_the_readme_is_a_front_page():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= 260
    in_block, long = False, []
    for n, line in enumerate(lines, 1):
        in_block ^= line.startswith("```")
        if not in_block and not line.startswith("|") and len(line) > 120:
            long.append(n)
    assert long == []


# -- the support table ----------------------------------------------------------------------------

TABLE_START = "<!-- {name} table: made from the code by tests/test_docs.py; edit the code, not the table -->"
TABLE_END = "<!-- end of {name} table -->"


def support_table() -> str:
    """The README's table of architectures and decoding paths, from the code: the model types the
    import takes, the plan's architectures, what the one-call step (and so the torch-free runner and
    the server's `--lean`) refuses for each one's config, and the aliases."""
    from helpers.hf_models import tiny_config
    from semoe.checkpoints.hf_config import from_hf_config
    from semoe.decode.support import ARCHITECTURES, one_call_refusal, plan_refusal
    from semoe.model.config import ARCHITECTURES as MODEL_ARCHITECTURES
    from semoe.model.hf_names import ALIASES, SEMOE_MODEL_TYPE, SUPPORTED_MODEL_TYPES, TEXT_MODELS, model_type_of

    def yes(ok: bool, why: str | None = None) -> str:
        return "yes" if ok else f"no ({why})" if why else "no"

    rows = ["| `model_type` | resident | offloaded | fast core (C kernels) | torch-free (`--lean`) "
            "| server (engine / `--lean`) |", "| --- | --- | --- | --- | --- | --- |"]
    for arch in SUPPORTED_MODEL_TYPES:
        if arch == SEMOE_MODEL_TYPE:
            continue
        config = from_hf_config(tiny_config(arch).to_dict())
        why, fast = one_call_refusal(config), plan_refusal(config) if arch in ARCHITECTURES else "not listed"
        also = [f"`{a}`" for a, (_, to) in ALIASES.items() if to == arch]
        also += [f"`{m}` (its text model)" for m in TEXT_MODELS if model_type_of(tiny_config(m).to_dict()) == arch]
        name = f"`{arch}`" + (f" (and {', '.join(also)})" if also else "")
        modules = arch in MODEL_ARCHITECTURES
        rows.append(f"| {name} | {yes(modules)} | {yes(modules)} | {yes(fast is None, fast)} | "
                    f"{yes(why is None, why)} | yes / {yes(why is None, why)} |")
    return "\n".join(rows)


# how weights are stored, as the README's formats table names them: (label, manifest dtype, quant)
FORMATS = (("float32", "F32", None), ("bfloat16", "BF16", None), ("float16", "F16", None),
           ("int8, a scale per row (`store quantize`, `--dense int8`)", "I8", {"scheme": "int8"}),
           ("int4, a scale per group (`store quantize --bits 4`)", "U8", {"scheme": "int4"}),
           ("FP8 e4m3, 128x128 scale tiles (DeepSeek-V3, Kimi-K2)", "F8_E4M3", {"scheme": "fp8", "block": [128, 128]}),
           ("FP8 e4m3, 1x128 scale blocks", "F8_E4M3", {"scheme": "fp8", "block": [1, 128]}),
           ("MXFP4 (gpt-oss)", "U8", {"scheme": "mxfp4"}))


def formats_table() -> str:
    """The README's table of stored formats and who reads them as stored: the engine (resident and
    offloaded) takes every format the store keeps; the torch-free runner what `tensor_refusal` allows."""
    from types import SimpleNamespace

    from inference.placement import tensor_refusal

    def lean(group: str, dtype: str, quant: dict | None) -> str:
        t = SimpleNamespace(kind="weight", group=group, dtype=dtype, quant=quant, name="w")
        return "no" if tensor_refusal(t) else "yes"

    rows = ["| stored as | dense: engine / torch-free | experts: engine / torch-free |", "| --- | --- | --- |"]
    rows += [f"| {label} | yes / {lean('dense', dtype, quant)} | yes / {lean('expert', dtype, quant)} |"
             for label, dtype, quant in FORMATS]
    return "\n".join(rows)


def _generated(name: str) -> str:
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    start, end = TABLE_START.format(name=name), TABLE_END.format(name=name)
    assert start in readme and end in readme, f"the README has no {name} table between {start} and {end}"
    return readme.split(start, 1)[1].split(end, 1)[0].strip()


def test_the_readme_support_tables_are_made_from_the_code():
    for name, made in (("architectures", support_table()), ("formats", formats_table())):
        assert _generated(name) == made, f"the README's {name} table differs from the code's:\n{made}"
