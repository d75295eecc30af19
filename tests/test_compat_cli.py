"""What a new user (often coming from vLLM) meets first on the ``engine`` command line: unknown flags
named as such, help that states each default once (the one used), a clear one-line error for a
context over the model's, a terminal chat that streams and quits on Ctrl-C, and the documented
commands' dependencies installed by the plain install."""

from __future__ import annotations

import re

import pytest
import tomllib

from kvloom.cli.main import build_parser, main
from tests.server_utils import REPO_ROOT


@pytest.mark.parametrize("argv,flag", [
    (["--max-prompt-adapters", "2"], "--max-prompt-adapters"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--model", "m", "generate", "--prompt", "hi", "--no-such-flag", "3"], "--no-such-flag"),
])
def test_an_unknown_flag_is_named_as_one(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized argument: {flag}" in err
    assert "invalid choice" not in err


def test_flags_of_a_subcommand_and_prefixes_still_parse(capsys):
    # --quantization checks its choices; an unambiguous prefix is what argparse accepts.
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--quantization", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err and exit_.value.code == 2
    args = build_parser().parse_args(["--max-num-se", "4", "generate", "--prompt", "x"])
    assert args.max_num_seqs == 4


def _help(*argv: str) -> str:
    parser = build_parser()
    sub = parser
    for name in argv:
        sub = next(a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]
    return " ".join(sub.format_help().split())


def test_help_states_each_default_once():
    text = _help()
    assert "(default: the model's)." in text
    assert not re.search(r"\(default: [^)]*\)\.? \(default:", text), "a flag states its default twice"


def test_generate_help_shows_the_offline_budget_it_uses():
    from kvloom.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS

    text = _help("generate")
    assert f"splits longer prompts). (default: {OFFLINE_MAX_NUM_BATCHED_TOKENS})" in text
    assert "(default: 2048)" not in text
    assert "(default: 2048)" in _help()  # the server's budget is still shown where it is used


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_options_have_help(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    own = [a for a in sub._actions if a.option_strings]
    assert own and all(a.help for a in own), [a.dest for a in own if not a.help]


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"]])
def test_max_model_len_over_the_model_is_one_line(tiny_llama, capsys, command):
    code = main([command[0], "--model", str(tiny_llama), "--num-kv-blocks", "32", "--max-model-len", "99999",
                 *command[1:]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "max_model_len=99999" in err and "512" in err


def test_chat_streams_and_ctrl_c_quits_cleanly(tiny_llama, monkeypatch, capsys):
    import builtins

    import kvloom.llm as llm_module

    made = []

    class Recording(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    real_print = builtins.print
    writes = []

    def recording_print(*args, **kwargs):
        writes.append("".join(map(str, args)))
        if len(writes) == 4:  # two pieces into the reply, the user presses Ctrl-C
            raise KeyboardInterrupt
        real_print(*args, **kwargs)

    monkeypatch.setattr(llm_module, "LLM", Recording)
    monkeypatch.setattr("builtins.input", lambda prompt="": "Hello!")
    monkeypatch.setattr("builtins.print", recording_print)
    assert main(["chat", "--model", str(tiny_llama), "--num-kv-blocks", "32", "--max-tokens", "60",
                 "--temperature", "1"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    # The reply is printed piece by piece as it is decoded, not once at the end.
    assert writes[1] == "assistant> " and writes[2] and writes[3], writes
    # The interrupted reply's request was aborted: nothing is left running in the engine.
    assert not made[0].engine.has_unfinished()


def test_stream_chat_yields_the_reply_piece_by_piece(tiny_llama):
    from kvloom import LLM, SamplingParams

    llm = LLM(str(tiny_llama), num_kv_blocks=32)
    messages = [{"role": "user", "content": "Paris is"}]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    pieces = list(llm.stream_chat(messages, params))
    assert len(pieces) >= 2
    assert "".join(pieces) == llm.chat(messages, params, use_tqdm=False)[0].text


def test_documented_commands_need_no_extra():
    # `engine bench serve/ab` import httpx: it must come with `pip install -e .` (README's set-up).
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert "httpx" in base


def test_serving_over_the_models_context_fails_without_a_traceback(tiny_llama, tmp_path):
    from tests.server_utils import EngineServer

    srv = EngineServer(["--model", str(tiny_llama), "--num-kv-blocks", "32", "--max-model-len", "99999"], tmp_path)
    try:
        code = srv.proc.wait(120)
    finally:
        srv.stop()
    log = srv.log()
    assert code != 0
    assert "max_model_len=99999 exceeds the model's max_position_embeddings=512" in log
    assert "Traceback" not in log, log
