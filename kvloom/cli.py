"""The ``engine`` command. Flags are generated from ``EngineConfig``; ``--config FILE.toml`` takes the
same keys. Subcommands: ``generate`` (offline prompts from a file or flags), ``chat`` (terminal) and
``plugins`` (list the available plugins)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing
from typing import Any

from kvloom.core.config import ConfigError, EngineConfig, _split_names


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with its help text and choices; defaults stay None so a
    config file's values are only overridden by flags the user actually gave."""
    group = parser.add_argument_group("engine options (also accepted as keys in --config FILE.toml)")
    group.add_argument("--config", metavar="FILE.toml", help="Read engine options from a TOML file.")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{f.metadata['help']} (default: {default!r})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_text}
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if hint is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.name == "plugins":
            kw["type"] = _split_names
            kw["metavar"] = "A,B"
        elif f.name in ("hf_overrides", "plugin_options"):
            kw["type"] = json.loads
            kw["metavar"] = "JSON"
        else:
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
            kw["type"] = base
        group.add_argument(_flag(f.name), **kw)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig.from_toml(args.config) if getattr(args, "config", None) else EngineConfig()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
               if getattr(args, f.name, None) is not None}
    config = config.replace(**changes)
    config.validate()
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine", description="kvloom: a pure-PyTorch LLM inference engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command")

    gen = sub.add_parser("generate", help="Generate offline for prompts given as flags or in a file.")
    gen.add_argument("--prompt", action="append", default=[], help="A prompt (repeatable).")
    gen.add_argument("--prompts-file", help="A file with one prompt per line, or JSONL with a 'prompt' field.")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt in the chat template as a user turn.")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed for sampling (reproducible text).")
    gen.add_argument("--output", help="Write JSONL results here instead of printing them.")
    add_engine_flags(gen)

    chat = sub.add_parser("chat", help="Chat with the model in the terminal.")
    chat.add_argument("--system", help="A system prompt.")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    add_engine_flags(chat)

    plugins = sub.add_parser("plugins", help="List every available plugin: its kind, origin and options "
                                             "(with --plugins/--config: also check that combination).")
    plugins.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    add_engine_flags(plugins)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 0
    from kvloom.plugins.manager import PluginManager

    try:
        config = config_from_args(args)
        plugins = PluginManager.from_config(config)  # unknown plugins and conflicts fail before a model loads
    except (ConfigError, ValueError, OSError) as e:
        print(f"engine: error: {e}", file=sys.stderr)
        return 2
    if args.command == "plugins":
        from kvloom.plugins.manager import format_listing

        rows = plugins.listing()
        print(json.dumps(rows, indent=2) if args.json else format_listing(rows))
        return 0
    if args.command == "generate":
        return _generate(args, config)
    if args.command == "chat":
        return _chat(args, config)
    return 0


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
    llm = LLM(config=config)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    lines = [json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                         "num_tokens": len(out.token_ids)}, ensure_ascii=False) for prompt, out in zip(prompts, outs)]
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))
    return 0


def _chat(args, config: EngineConfig) -> int:
    from kvloom.core.sampling_params import SamplingParams
    from kvloom.llm import LLM

    llm = LLM(config=config)
    history = [{"role": "system", "content": args.system}] if args.system else []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print("kvloom chat: type a message, an empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].text
        print(f"assistant> {reply}")
        history.append({"role": "assistant", "content": reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
