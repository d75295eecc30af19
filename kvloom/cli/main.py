"""The ``engine`` command. With no subcommand it serves the OpenAI API (and optionally the ZMQ gateway);
``generate`` runs prompts from a file or flags offline, ``chat`` is a terminal chat, ``plugins`` lists
the available plugins, ``models`` the architectures served, ``bench serve``/``bench ab`` load-test servers and ``plan`` does the memory
arithmetic of a deployment. Flags are generated from ``EngineConfig`` and ``ServerConfig``; ``--config
FILE.toml`` takes the same keys."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from typing import Any

import tomllib

from kvloom.cli.vllm_flags import add_vllm_flags, apply_vllm_flags
from kvloom.core.config import (
    OFFLINE_MAX_NUM_BATCHED_TOKENS,
    ConfigError,
    EngineConfig,
    _split_names,
    parse_lora_module,
)
from kvloom.frontends.config import ServerConfig, check_field_types
from kvloom.launch.served_models import (
    ServedModel,
    check_memory_shares,
    models_from_flags,
    models_from_tables,
    split_model_flag,
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(group, cls, skip: tuple[str, ...] = (), shown_defaults: dict[str, Any] | None = None) -> None:
    """One flag per field of the config dataclass ``cls``, with its help text and choices. Defaults are
    suppressed so a config file's values are only overridden by flags the user actually gave;
    ``shown_defaults`` names the defaults a subcommand uses instead of the field's."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = (shown_defaults or {}).get(f.name, default)
        help_text = f.metadata["help"]
        if "(default" not in help_text:  # help that explains its default already must not say it twice
            help_text += f" (default: {default!r})"
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if hint is bool or set(typing.get_args(hint)) == {bool, type(None)}:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.name == "model":  # serving takes several: --model NAME=PATH, repeated
            kw["action"] = "append"
        elif f.name == "plugins":
            kw["type"] = _split_names
            kw["metavar"] = "A,B"
        elif f.name == "lora_modules":
            kw["nargs"] = "+"
            kw["type"] = _lora_module_flag
            kw["metavar"] = "NAME=PATH"
        elif f.name in ("hf_overrides", "kernel_options", "plugin_options", "api_keys"):
            kw["type"] = json.loads
            kw["metavar"] = "JSON"
        else:
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
            kw["type"] = base
        group.add_argument(_flag(f.name), **kw)


def _lora_module_flag(text: str) -> tuple[str, str]:
    try:
        return parse_lora_module(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                     shown_defaults: dict[str, Any] | None = None) -> None:
    group = parser.add_argument_group("engine options (also accepted as keys in --config FILE.toml)")
    group.add_argument("--config", metavar="FILE.toml", default=argparse.SUPPRESS,
                       help="Read options from a TOML file with the flags' names as keys (e.g. max_num_seqs = 64); "
                            "flags given on the command line win.")
    add_config_flags(group, EngineConfig, skip, shown_defaults)


def config_flags(config) -> list[str]:
    """The flags that give ``config`` (the inverse of add_config_flags; fields at their default are left out)."""
    default = type(config)()
    flags = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == getattr(default, f.name):
            continue
        if isinstance(value, bool):
            flags.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
        elif f.name == "plugins":
            flags += [_flag(f.name), ",".join(value)]
        elif f.name == "lora_modules":
            flags += [_flag(f.name), *(f"{name}={path}" for name, path in value.items())]
        elif isinstance(value, (dict, list)):
            flags += [_flag(f.name), json.dumps(value)]
        else:
            flags += [_flag(f.name), str(value)]
    return flags


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serving options (also accepted as keys in --config FILE.toml)")
    add_config_flags(group, ServerConfig)


def _read_config_file(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config file's keys, split into (engine keys, serving keys)."""
    path = getattr(args, "config", None)
    if not path:
        return {}, {}
    with open(path, "rb") as f:
        data = tomllib.load(f)
    data.pop("models", None)  # [[models]] tables: see served_models_from_args
    server_keys = ServerConfig.keys()
    return ({k: v for k, v in data.items() if k not in server_keys},
            {k: v for k, v in data.items() if k in server_keys})


def _given(args: argparse.Namespace, cls) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    engine_keys, _ = _read_config_file(args)
    given = _given(args, EngineConfig)
    if "lora_modules" in given:  # NAME=PATH pairs: they replace the config file's table, as other flags do
        given["lora_modules"] = dict(given["lora_modules"])
    model_flags = given.pop("model", None)  # a list: serving may take several (served_models_from_args)
    if model_flags:
        given["model"] = split_model_flag(model_flags[0])[1]
    config = EngineConfig.from_dict(engine_keys).replace(**given)
    check_field_types(config)  # a wrong type names its key, not a failed comparison
    config.validate()
    return config


def served_models_from_args(args: argparse.Namespace, config: EngineConfig,
                            server: ServerConfig) -> tuple[list[ServedModel] | None, ServerConfig]:
    """The models to serve when there are several (``[[models]]`` tables or repeated ``--model
    NAME=PATH``), else None; one ``--model NAME=PATH`` just names the one model."""
    flags = getattr(args, "model", None) or []
    path = getattr(args, "config", None)
    tables = None
    if path:
        with open(path, "rb") as f:
            tables = tomllib.load(f).get("models")
    if tables is not None and flags:
        raise ConfigError("give the served models either as [[models]] tables in the config file or as --model "
                          "flags, not both")
    if tables is not None:
        models = models_from_tables(tables, config)
    elif len(flags) > 1:
        models = models_from_flags(flags, config)
    else:
        name = split_model_flag(flags[0])[0] if flags else None
        if name is not None:
            if server.served_model_name is not None:
                raise ConfigError(f"--model {flags[0]!r} names the model already; leave out served_model_name")
            server = server.replace(served_model_name=name)
        return None, server
    if server.ray_address is not None:
        raise ConfigError("ray_address runs the replicas of one model; serving several models on Ray is not "
                          "supported yet")
    if server.engine_address is not None:
        raise ConfigError(f"engine_address={server.engine_address!r} names one engine, but several models start "
                          "several: leave it unset (each engine gets its own ipc:// socket)")
    if server.served_model_name is not None:
        raise ConfigError("served_model_name names the one model of a server; with several models each has "
                          "its own name ([[models]] name, or --model NAME=PATH)")
    return models, server


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    _, server_keys = _read_config_file(args)
    config = ServerConfig(**server_keys).replace(**_given(args, ServerConfig))
    config.validate()
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="kvloom: a pure-PyTorch LLM inference engine. With no subcommand, serve the OpenAI-compatible "
                    "API: engine --model PATH --plugins a,b --host 127.0.0.1 --port 8000",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_flags(parser)
    add_server_flags(parser)
    add_vllm_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="{generate,chat,plugins,models,bench,plan}")

    gen = sub.add_parser("generate", help="Generate offline for prompts given as flags or in a file.")
    gen.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    gen.add_argument("--prompts-file", help="A file with one prompt per line, or JSONL with a 'prompt' field.")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt in the chat template as a user turn.")
    gen.add_argument("--max-tokens", type=int, default=128,
                     help="Most tokens to generate per prompt (default: %(default)s).")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="Sampling temperature; 0 is greedy (default: %(default)s).")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="Nucleus sampling: keep the smallest set of tokens whose probability reaches this "
                          "(default: %(default)s).")
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed for sampling (reproducible text).")
    gen.add_argument("--output", help="Write JSONL results here instead of printing them.")
    gen.add_argument("--lora", metavar="NAME", help="Run every prompt with this LoRA adapter (one of --lora-modules).")
    add_engine_flags(gen, shown_defaults={"max_num_batched_tokens": OFFLINE_MAX_NUM_BATCHED_TOKENS})

    chat = sub.add_parser("chat", help="Chat with the model in the terminal (replies stream as they are made).")
    chat.add_argument("--system", help="A system prompt.")
    chat.add_argument("--max-tokens", type=int, default=512,
                      help="Most tokens per reply (default: %(default)s).")
    chat.add_argument("--temperature", type=float, default=0.7,
                      help="Sampling temperature; 0 is greedy (default: %(default)s).")
    chat.add_argument("--log-file", help="Where the engine's log goes while you chat, so it never lands inside a "
                                         "reply (default: chat.log in kvloom's cache folder); warnings and "
                                         "errors still show on the terminal.")
    add_engine_flags(chat)

    plugins = sub.add_parser("plugins", help="List every available plugin: kind, origin and options "
                                             "(and check a combination given with --plugins/--config).")
    plugins.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    add_engine_flags(plugins)

    models = sub.add_parser("models", help="List the model architectures kvloom serves (config.json's "
                                           "'architectures') and the family file that serves each.")
    models.add_argument("--json", action="store_true", help="Print JSON instead of text.")

    from kvloom.bench.commands import add_bench_parser

    add_bench_parser(sub, add_engine_flags)

    plan = sub.add_parser("plan", help="Weights, KV bytes per token, KV capacity and maximum concurrency of a "
                                       "model on a device, per tensor-parallel size (the engine's own arithmetic).")
    plan.add_argument("--config-json", metavar="FILE", help="A model's config.json (instead of --model).")
    plan.add_argument("--gpu-memory", type=float, metavar="GiB", help="Memory of one GPU (a GPU plan).")
    plan.add_argument("--tensor-parallel-sizes", default="1,2,4,8", metavar="N,N",
                      help="GPU plan: tensor-parallel sizes to show (those that split the heads evenly).")
    plan.add_argument("--data-parallel-sizes", default="1", metavar="N,N",
                      help="Also show N replicas (--data-parallel-size N) of each row: GPUs, memory and KV "
                           "capacity of them all.")
    plan.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    add_engine_flags(plan)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def reject_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Exit with "unrecognized argument: --x" for a flag no parser on the way knows. argparse alone would
    take ``awq`` in ``engine --quantization awq`` for the subcommand and answer "invalid choice: 'awq'"."""
    current = parser
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            return
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            actions = current._option_string_actions
            # argparse takes an unambiguous prefix of a flag; so does this check.
            matches = [actions[name]] if name in actions else list({id(a): a for k, a in actions.items()
                                                                    if k.startswith(name)}.values())
            if len(matches) != 1:
                where = "engine" if current is parser else current.prog
                current.error(f"unrecognized argument: {name} ({where} has no such flag; "
                              f"`{where} --help` lists them)")
            if "=" not in token and matches[0].nargs is None:
                next(tokens, None)  # the flag's value
        elif token in _subcommands(current):
            current = _subcommands(current)[token]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    reject_unknown_flags(parser, argv)
    args = parser.parse_args(argv)
    if args.command == "chat":
        args.log_file = _chat_logging(args)
    else:
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from kvloom.plugins.manager import PluginManager

    try:
        config = apply_vllm_flags(args, config_from_args(args))
        server = server_config_from_args(args) if args.command is None else None
        models = None
        if server is not None:
            models, server = served_models_from_args(args, config, server)
            if models is not None:
                check_memory_shares(models, serving_device(config))
        elif len(getattr(args, "model", None) or []) > 1:
            raise ConfigError(f"engine {args.command} runs one model: give --model once")
        # unknown plugins and conflicts fail before a model loads (plan checks --quantization itself: its
        # model may be a --config-json, not --model)
        plugins = PluginManager.from_config(config.replace(quantization=None) if args.command == "plan" else config)
    except (ConfigError, ValueError, TypeError, OSError) as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 2
    if args.command == "bench":
        from kvloom.bench.commands import run_bench

        return run_bench(args, config, config_flags)
    if args.command == "plan":
        from kvloom.cli import plan

        return plan.run_plan(args, config)
    if args.command == "models":
        rows = model_listing()
        print(json.dumps(rows, indent=2) if args.json else format_models(rows))
        return 0
    if args.command == "plugins":
        from kvloom.plugins.manager import format_listing

        rows = plugins.listing()
        print(json.dumps(rows, indent=2) if args.json else format_listing(rows))
        return 0
    if args.command in ("generate", "chat"):
        try:
            return _generate(args, config) if args.command == "generate" else _chat(args, config)
        except (ConfigError, ValueError, OSError) as e:  # e.g. --max-model-len over the model's limit
            print(f"engine {args.command}: error: {e}", file=sys.stderr)
            return 2
    from kvloom.core.model.files import resolve_model
    from kvloom.launch.launcher import serve

    try:
        for model in [m.engine.model for m in models] if models else [config.model]:
            check_architecture(resolve_model(model))  # a wrong path fails here, not in three processes at once
        check_chat_template(server)
        return serve(config, server, args.log_level, models)
    except (OSError, ValueError) as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 2


def check_architecture(path) -> None:
    """A model folder whose config.json lists an architecture no family serves fails before any process
    starts, naming it and the supported ones."""
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        from types import SimpleNamespace

        from kvloom.core.model.families import architecture_of

        listed = json.loads(config.read_text()).get("architectures")
        if listed:
            architecture_of(SimpleNamespace(architectures=listed))


def model_listing() -> list[dict[str, str]]:
    """One row per supported architecture: its name, the family file serving it and what that file says."""
    from kvloom.core.model.families import registry

    rows = []
    for arch, cls in sorted(registry().items()):
        module = sys.modules[cls.__module__]
        summary = " ".join((module.__doc__ or "").split())
        rows.append({"architecture": arch, "family": cls.__module__.rpartition(".")[2], "summary": summary})
    return rows


def format_models(rows: list[dict[str, str]]) -> str:
    width = max(len(r["architecture"]) for r in rows)
    lines = [f"{len(rows)} supported architectures (config.json 'architectures'; GGUF files map onto them):"]
    lines += [f"  {r['architecture']:<{width}}  [{r['family']}] {r['summary']}" for r in rows]
    return "\n".join(lines)


def serving_device(config: EngineConfig) -> str:
    if config.device != "auto":
        return config.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_chat_template(server: ServerConfig) -> None:
    """A --chat-template that is neither a file nor a template fails before any process starts."""
    if server.chat_template is not None:
        from kvloom.frontends.text import load_chat_template

        load_chat_template(server.chat_template)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                prompts.append(json.loads(line)["prompt"] if line.lstrip().startswith("{") else line)
    return prompts


def _generate(args, config: EngineConfig) -> int:
    from kvloom.core.sampling_params import SamplingParams
    from kvloom.llm import LLM

    prompts = _read_prompts(args)
    if not prompts:
        print("engine generate: error: give --prompt or --prompts-file", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed)
    if not hasattr(args, "max_num_batched_tokens") and "max_num_batched_tokens" not in _read_config_file(args)[0]:
        config = config.replace(max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)  # as LLM() defaults
    llm = LLM(config=config)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, lora=args.lora)
    else:
        outs = llm.generate(prompts, params, lora=args.lora)
    lines = [json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                         "num_tokens": len(out.token_ids)}, ensure_ascii=False) for prompt, out in zip(prompts, outs)]
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(lines) + "\n")
        tokens = sum(len(out.token_ids) for out in outs)
        print(f"engine generate: wrote {len(lines)} result(s) ({tokens} generated tokens) to {args.output}")
    else:
        print("\n".join(lines))
    return 0


def _chat_logging(args) -> str:
    """A chat screen shows the conversation only: the log goes to a file (its path returned), and the
    terminal gets warnings and errors alone (an engine's INFO line would land in a streamed reply)."""
    from pathlib import Path

    from kvloom.core.model.files import cache_dir

    path = Path(args.log_file) if args.log_file else cache_dir() / "chat.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(path)
    to_file.setFormatter(fmt)
    to_terminal = logging.StreamHandler()
    to_terminal.setLevel(logging.WARNING)
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[to_file, to_terminal])
    return str(path)


def _chat(args, config: EngineConfig) -> int:
    import contextlib

    from kvloom.core.sampling_params import SamplingParams
    from kvloom.llm import LLM

    try:
        llm = LLM(config=config)
        history = [{"role": "system", "content": args.system}] if args.system else []
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        # Named once the engine is up, in the one greeting line: a bad flag's error stays a single line.
        print(f"kvloom chat: type a message, an empty line, Ctrl-D or Ctrl-C to quit (the engine's log: "
              f"{args.log_file}).")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            if not line:
                break
            history.append({"role": "user", "content": line})
            print("assistant> ", end="", flush=True)
            reply = ""
            with contextlib.closing(llm.stream_chat(history, params)) as pieces:
                for piece in pieces:
                    print(piece, end="", flush=True)
                    reply += piece
            print()
            history.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:  # the stream's own cleanup has aborted its request; quit without a traceback
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
