"""The ``engine`` command line: every flag documented, config file keys, offline generation."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from kvloom.cli.main import build_parser, config_from_args, main, server_config_from_args
from kvloom.core.config import EngineConfig
from kvloom.frontends.config import ServerConfig


def all_fields():
    return [f for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls) if f.name != "plugin_options"]


def test_help_documents_every_flag():
    text = " ".join(build_parser().format_help().split())
    for f in all_fields():
        assert "--" + f.name.replace("_", "-") in text, f.name
        assert " ".join(f.metadata["help"].split())[:40] in text, f.name
    assert "generate" in text and "chat" in text and "--config" in text


def test_config_file_takes_the_flag_names_and_flags_win(tmp_path):
    path = tmp_path / "kvloom.toml"
    path.write_text('model = "m.gguf"\nmax_num_seqs = 8\nport = 9000\napi_workers = 3\nplugins = "a,b"\n')
    args = build_parser().parse_args(["--config", str(path), "--port", "9001", "--max-num-seqs", "4"])
    engine, server = config_from_args(args), server_config_from_args(args)
    assert (engine.model, engine.max_num_seqs, engine.plugins) == ("m.gguf", 4, ["a", "b"])
    assert (server.port, server.api_workers, server.host) == (9001, 3, "127.0.0.1")
    # Subcommands read the same file (serving keys are simply not theirs), and flags before them count.
    args = build_parser().parse_args(["--max-num-seqs", "2", "generate", "--config", str(path), "--prompt", "x"])
    assert config_from_args(args).max_num_seqs == 2 and config_from_args(args).model == "m.gguf"


@pytest.mark.parametrize("content,words", [
    ('modle = "x"\n', ["unknown config keys", "modle"]),
    ("api_workers = 0\n", ["api_workers=0", ">= 1"]),
    ('gateway = "localhost:5"\n', ["gateway", "ipc://"]),
])
def test_bad_config_is_a_clear_error(tmp_path, capsys, content, words):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_missing_model_or_busy_port_fail_at_once(tiny_llama, capsys):
    assert main(["--model", "/no/such/model"]) == 2
    assert "/no/such/model" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["--port", str(s.getsockname()[1]), "--model", str(tiny_llama)]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_a_port_held_by_a_server_still_loading_fails_before_any_model_loads(tiny_llama, capsys, monkeypatch):
    # The first server's launcher holds the port while its model loads (no worker is serving yet); a
    # second one on that port must stop at once, not bind too and serve nothing.
    from kvloom.launch.launcher import Launcher, bind_http_socket

    spawned = []
    monkeypatch.setattr(Launcher, "_spawn", lambda self, module, *a, **k: spawned.append(module) or 1 / 0)
    first = bind_http_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        assert main(["--port", str(port), "--model", str(tiny_llama)]) == 2
    finally:
        first.close()
    err = capsys.readouterr().err
    assert spawned == []  # no engine process was started, so no model was loaded
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err and f"port {port}" in err, err


def test_generate_from_a_prompts_file(tiny_llama, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('Hello there\n{"prompt": "Paris is"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_llama), "--num-kv-blocks", "32", "--prompts-file", str(prompts),
                 "--max-tokens", "3", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello there", "Paris is"]
    assert all(r["num_tokens"] == 3 or r["finish_reason"] == "stop" for r in rows)
    tokens = sum(r["num_tokens"] for r in rows)
    assert f"wrote 2 result(s) ({tokens} generated tokens) to {out}" in capsys.readouterr().out


def test_chat_screen_shows_the_conversation_and_logs_go_to_a_file(tiny_llama, tmp_path):
    import shutil
    import subprocess
    import sys

    from tests.server_utils import REPO_ROOT, server_env

    # A config without "dtype" (a GGUF's, or one saved by older transformers): reading the old
    # torch_dtype name made transformers warn on every start.
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    log = tmp_path / "chat.log"
    run = subprocess.run([sys.executable, "-m", "kvloom.cli", "chat", "--model", str(model), "--num-kv-blocks", "32",
                          "--max-tokens", "4", "--temperature", "0", "--log-file", str(log)],
                         input="Hello there\n\n", capture_output=True, text=True, env=server_env(), cwd=REPO_ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    screen = run.stdout + run.stderr
    assert "you> assistant> " in screen and f"(the engine's log: {log})." in run.stdout
    assert not [line for line in screen.splitlines() if "INFO" in line], screen  # not a single log line
    assert "torch_dtype" not in screen and "torch_dtype" not in log.read_text()
    assert "INFO kvloom: Loaded" in log.read_text()  # the engine's log is kept, in the file


@pytest.mark.parametrize("flags,expect", [([], 4096), (["--max-num-batched-tokens", "64"], 64)])
def test_generate_takes_the_offline_step_budget_unless_given(tiny_llama, monkeypatch, flags, expect):
    import kvloom.llm as llm_module

    assert llm_module.OFFLINE_MAX_NUM_BATCHED_TOKENS == 4096
    seen = []

    class Recording(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self.engine.config.max_num_batched_tokens)

    monkeypatch.setattr(llm_module, "LLM", Recording)
    assert main(["generate", "--model", str(tiny_llama), "--num-kv-blocks", "32", "--prompt", "Hi",
                 "--max-tokens", "2", *flags]) == 0
    assert seen == [expect]


def test_chat_in_the_terminal(tiny_llama, monkeypatch, capsys):
    lines = iter(["Hello!", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(tiny_llama), "--num-kv-blocks", "32", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 1
