"""prompts/*.md load, the briefing renders with every field, and a missing or unknown field is named."""

from __future__ import annotations

import re

import pytest

from agent import prompts
from agent.prompts import PromptError, load_prompt, render_briefing, system_prompt, template_fields

FIELDS = dict(
    task_name="softmax",
    task_description="Row softmax of a bf16 matrix, fp32 math.",
    target="cuda (sm_90a)",
    gpu_name="NVIDIA H200 (132 SMs)",
    driver="580.159.04",
    compiler="nvcc 13.0 (V13.0.88)",
    flags="-O3 -std=c++17",
    peak_rates="bf16 790 TFLOP/s (measured), DRAM 4.2 TB/s (measured copy)",
    bench_table=(
        "| shape | dims | FLOPs | bytes | roofline | bound | baseline | % of roofline | comparators |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        "| 65536x4096 | {rows: 65536, cols: 4096} | 1.3e9 | 1.07 GB | 256 us | memory | 610 us | 42% | torch.softmax 300 us |"
    ),
    knobs_table="| knob | values | current | help |\n|---|---|---|---|\n| VEC | 1, 2, 4, 8 | 1 | bf16 per load |",
    editable_files="softmax.cu, *.cuh (matches: softmax.cu)",
    check_shapes="1x1, 3x7, 33x6, ... and every bench shape",
    tolerance="|y-ref| <= 1e-12 + 2e-2*|ref|; ||y-ref||/||ref|| <= 1e-2",
    forbidden="- `cudaMalloc`: no hidden allocations",
    min_gain="1% (lower bound of the workload speedup > 1.01)",
    max_regression="3% on every bench shape",
    budget="200 turns, 30 attempts, 4 hours",
)


@pytest.mark.parametrize("name", ["system", "briefing", "hopper", "cpu"])
def test_prompts_load(name):
    text = load_prompt(name)
    assert len(text) > 500
    assert text == load_prompt(f"{name}.md")


def test_prompts_dir_is_the_repo_folder():
    assert prompts.PROMPTS_DIR.name == "prompts"
    assert (prompts.PROMPTS_DIR.parent / "agent" / "prompts.py").is_file()


def test_unknown_or_bad_prompt_name():
    with pytest.raises(PromptError, match="no prompt 'nope'.*have:.*system"):
        load_prompt("nope")
    with pytest.raises(FileNotFoundError):  # callers treating playbooks as optional catch this
        load_prompt("nope")
    with pytest.raises(PromptError, match="bare name"):
        load_prompt("../pyproject")


def test_system_prompt_says_the_rules():
    text = load_prompt("system")
    for phrase in ("submit(title, rationale)", "NaN", "lower confidence bound", "editable", "notes", "revert"):
        assert phrase in text, phrase


def test_system_prompt_with_playbook():
    cuda = system_prompt("cuda", "sm_90a")
    assert cuda.startswith(load_prompt("system").rstrip())
    assert "wgmma" in cuda and "HGMMA" in cuda
    cpu = system_prompt("cpu")
    assert "Cache blocking" in cpu and "wgmma" not in cpu
    assert system_prompt() == load_prompt("system").rstrip() + "\n"
    assert prompts.playbook_name("cuda", "sm_80") is None


def test_briefing_fields_match_the_documented_ones():
    fields = template_fields("briefing")
    assert set(fields) == set(FIELDS)
    # every placeholder is documented in the leading comment
    doc = re.match(r"\s*<!--(.*?)-->", load_prompt("briefing"), re.S).group(1)
    for f in fields:
        assert "{" + f + "}" in doc, f


def test_briefing_renders_with_all_fields():
    text = render_briefing(**FIELDS)
    assert "<!--" not in text  # the documentation comment is stripped
    assert text.startswith("# Task: softmax")
    for value in FIELDS.values():
        assert value in text  # braces inside values are kept literally
    assert "{" + "task_name" + "}" not in text


def test_briefing_missing_field_is_named():
    partial = dict(FIELDS)
    del partial["min_gain"]
    with pytest.raises(PromptError, match=r"missing field: min_gain"):
        render_briefing(**partial)
    del partial["budget"]
    with pytest.raises(PromptError, match=r"missing fields: min_gain, budget|missing fields: budget, min_gain"):
        render_briefing(**partial)


def test_briefing_unknown_field_is_named():
    with pytest.raises(PromptError, match=r"unknown field \(not in the template\): gpu_clock"):
        render_briefing(**FIELDS, gpu_clock="1980 MHz")


def test_values_are_stringified():
    text = render_briefing(**{**FIELDS, "min_gain": 0.01})
    assert "Minimum gain: 0.01" in text
