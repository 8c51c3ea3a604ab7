"""The configs' one variant parser, and the configs that use it refusing what they did not."""

import glob
import importlib
import os
import re
import subprocess
import sys

import pytest

from rl_tpu.recipes import variants
from rl_tpu.recipes.variants import parse_variant

LOSSES, SETTINGS = ("bapo", "clip", "clip_higher"), ("s0", "s2", "s4")
GROUPS = {"loss": LOSSES, "setting": SETTINGS}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("arg, expected", [
    ("", ({"loss": "bapo", "setting": "s2"}, False)),           # defaults: first, or given
    ("clip_higher,s4", ({"loss": "clip_higher", "setting": "s4"}, False)),
    ("s0,smoke", ({"loss": "bapo", "setting": "s0"}, True)),   # any order
    ("smoke", ({"loss": "bapo", "setting": "s2"}, True)),
    (" clip , smoke ,", ({"loss": "clip", "setting": "s2"}, True)),
])
def test_names_from_each_group_and_smoke(arg, expected):
    assert parse_variant(arg, GROUPS, {"setting": "s2"}) == expected


@pytest.mark.parametrize("arg, message", [
    ("bapo,s9", r"'s9' is not a choice.*loss: bapo, clip, clip_higher; setting: s0, s2, s4"),
    ("bapo,clip", r"'clip' is a second loss \(after 'bapo'\)"),
    ("smoke,smoke", r"'smoke' is given twice"),
])
def test_refuses_what_is_not_a_variant(arg, message):
    with pytest.raises(ValueError, match=message):
        parse_variant(arg, GROUPS)


def test_a_default_must_be_a_choice():
    with pytest.raises(ValueError, match="default 's9' of group 'setting'"):
        parse_variant("", GROUPS, {"setting": "s9"})


@pytest.mark.parametrize("name, arg", [
    ("bapo_offpolicy", "bapo,clip"), ("dpo_largest", "ipo,inpo"), ("rloop_largest", "rlop"),
    ("siri_arithmetic", "siri,cosine"), ("tipping_routes", "kl,smoke,smoke"),
    ("babyai_cpu", "fixed,scaling"), ("babyai_cpu", "seed1,seed2"), ("agentgym", "babyai,sciworld"),
    ("countdown_grpo", "fast"), ("quickstart", "sft-only"), ("tl_grpo_babyai", "fixd"),
    ("bapo_entropy", "bapo,clip"), ("bapo_entropy", "s4,s8"), ("tl_grpo_guess", "grpo,tl_grpo"),
    ("selfplay_arithmetic", "peak,band"),
])
def test_configs_refuse_two_of_a_group_or_a_typo(name, arg):
    sys.path.insert(0, REPO)
    try:
        module = importlib.import_module(f"configs.{name}")
    finally:
        sys.path.remove(REPO)
    with pytest.raises(ValueError, match=f"variant '{arg}'"):
        module.get_config(arg)


@pytest.mark.parametrize("arg, expected", [
    ("", ({"horizon": "fixed", "seed": 0}, False)),
    ("scaling,seed3", ({"horizon": "scaling", "seed": 3}, False)),
    ("seed12,smoke", ({"horizon": "fixed", "seed": 12}, True)),
])
def test_numbered_names(arg, expected):
    assert parse_variant(arg, {"horizon": ("fixed", "scaling")}, numbered={"seed": 0}) == expected


@pytest.mark.parametrize("arg, message", [
    ("seed1,seed2", r"'seed2' is a second seed \(after 1\)"),
    ("seedx", r"'seedx' is not a choice.*seed: seed<N>"),
])
def test_numbered_names_refused(arg, message):
    with pytest.raises(ValueError, match=message):
        parse_variant(arg, {"horizon": ("fixed", "scaling")}, numbered={"seed": 0})


def test_a_config_without_groups_takes_only_smoke():
    assert parse_variant("smoke", {}) == ({}, True)
    with pytest.raises(ValueError, match=r"'fast' is not a choice; this config takes '' .* 'smoke'"):
        parse_variant("fast", {})


# ---------------------------------------------------------------------------------------------
# Every config names its variants and shows its smoke runs (`--list_variants`)
# ---------------------------------------------------------------------------------------------

CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))


def launcher_flags(module: str) -> set:
    """The flags a launcher defines (its source's DEFINE_*("name", ...) calls) plus absl's."""
    with open(os.path.join(REPO, *module.split(".")) + ".py") as f:
        source = f.read()
    defined = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
    if "launch.run(" in source:
        defined.add("list_variants")
    return defined


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_names_its_variants_and_shows_smoke_runs_that_parse(path):
    module = variants.load_config_file(path)
    groups, _, _ = variants.variants_of(module)
    names = {name for choices in groups.values() for name in choices}
    assert set(getattr(module, "VARIANT_HELP", {})) == names, "VARIANT_HELP: one line a name"
    commands = variants.smoke_commands(module)
    assert commands, f"{path}: no smoke command in its 'Smoke runs' docstring paragraph"
    for words in commands:
        launcher, args = words[0], words[1:]
        defined = launcher_flags(launcher)
        config_arg = next(a.split("=", 1)[1] if "=" in a else args[i + 1]
                          for i, a in enumerate(args) if a.split("=")[0] == "--config")
        config_file, _, variant = config_arg.partition(":")
        config = variants.load_config_file(os.path.join(REPO, config_file)).get_config(variant)
        for arg in args:
            key = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
            if key and key.startswith("config."):  # an override: a key the config has
                node = config
                for part in key.split(".")[1:]:
                    node = node[part]
            elif key:
                assert key in defined, f"{' '.join(words)}: {launcher} has no --{key}"


def test_list_variants_prints_a_configs_variants_and_smoke_runs():
    run = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/rlhf_largest.py",
         "--list_variants"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "rm       (default) the reward model's score alone" in run.stdout
    assert "gold     the env's exact reward (the control)" in run.stdout
    assert "seed<N>" in run.stdout and "smoke " in run.stdout
    assert "--config configs/rlhf_largest.py:gold,smoke" in run.stdout
