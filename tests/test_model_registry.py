"""The model registry: every family file registers the architectures it serves, ``engine models`` lists
them, and an architecture no family serves fails at start-up naming it and the supported ones."""

from __future__ import annotations

import json

import pytest

from kvloom.cli.main import main
from kvloom.core.model.families import registry, supported_architectures
from tests.conftest import MOE_FAMILIES, TINY_FAMILIES


def test_every_tiny_family_is_registered_by_its_own_file():
    served = registry()
    for _, arch, _ in [*TINY_FAMILIES.values(), *MOE_FAMILIES.values()]:
        assert arch in served
    # one file per family: each class lives in its own module and names what it serves
    assert len({cls.__module__ for cls in served.values()}) == len(set(served.values()))
    for arch, cls in served.items():
        assert arch in cls.architectures


def test_engine_models_lists_the_supported_architectures(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["architecture"] for r in rows] == supported_architectures()
    assert all(r["summary"] and r["family"] for r in rows)
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert all(arch in text for arch in supported_architectures())


@pytest.mark.parametrize("model_type", ["gpt2", "no_such_type"])
def test_unsupported_architecture_fails_at_start_up_naming_it(tmp_path, capsys, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": model_type}))
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'GPT2LMHeadModel'" in err and "LlamaForCausalLM" in err and "Qwen3ForCausalLM" in err
    from kvloom import LLM

    with pytest.raises(ValueError, match=r"unsupported model architecture 'GPT2LMHeadModel'; supported: \[.*"
                                         r"'LlamaForCausalLM'"):
        LLM(str(tmp_path))
