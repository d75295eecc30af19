"""Speculative-decoding plugin ``spec_decode``: proposes draft tokens that the engine verifies with the
target model in the same flat batch (greedy: exact; sampling: rejection sampling, which keeps the
target distribution). Methods: ``ngram`` (prompt lookup, the default) and ``draft`` (a smaller model of
the same vocabulary)."""

from __future__ import annotations

from typing import Any

from kvloom.core.config import ConfigError
from kvloom.plugins import hookimpl
from kvloom.plugins.info import PluginInfo, PluginOption

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


class SpecDecodeOptionError(ConfigError):
    """An option value of spec_decode that cannot work; the message names it and the limit."""


@hookimpl
def kvloom_plugin_info() -> PluginInfo:
    return PluginInfo(
        kind="spec_decode",
        description="Speculative decoding: draft tokens from n-gram prompt lookup or a draft model, verified "
                    "by the target in one batch (lossless: exact when greedy, rejection sampling otherwise).",
        options=(
            PluginOption("method", "ngram", "Where drafts come from: ngram (prompt lookup over the request's own "
                         "tokens) or draft (a smaller model with the same vocabulary, see draft_model).",
                         choices=METHODS),
            PluginOption("num_speculative_tokens", 3, f"Draft tokens per request per step (1..{MAX_SPECULATIVE_TOKENS})."),
            PluginOption("prompt_lookup_min", 2, "ngram: shortest tail n-gram to look up."),
            PluginOption("prompt_lookup_max", 4, "ngram: longest tail n-gram to look up (tried first)."),
            PluginOption("draft_model", "", "draft: the draft model (any model kvloom loads: folder, .gguf)."),
            PluginOption("draft_dtype", "auto", "draft: the draft model's dtype.",
                         choices=("auto", "float32", "bfloat16", "float16")),
            PluginOption("adaptive", True, "Skip proposing where it cannot pay off (the rules below)."),
            PluginOption("goodput", True, "Propose only the drafts that raise the step's expected tokens per "
                         "second, by a model of step time against step size fitted to the engine's recent steps "
                         "(compute-bound steps: none; memory-bound: nearly all)."),
            PluginOption("min_acceptance", 0.2, "A request whose recent acceptance rate falls below this stops "
                         "proposing for retry_after_steps steps."),
            PluginOption("retry_after_steps", 16, "Steps a low-acceptance request waits before proposing again."),
            PluginOption("max_batch_size", 32, "Steps with more running requests than this propose nothing "
                         "(compute-bound; 0: no limit)."),
        ),
    )


@hookimpl
def kvloom_spec_proposer(hf_config: Any, config: Any, options: dict[str, Any]):
    from kvloom.core.engine.speculation import SpeculationPolicy

    check_options(options)
    k = options["num_speculative_tokens"]
    policy = SpeculationPolicy(min_acceptance=options["min_acceptance"], retry_after_steps=options["retry_after_steps"],
                               max_batch_size=options["max_batch_size"], adaptive=options["adaptive"],
                               goodput=options["goodput"])
    if options["method"] == "ngram":
        from kvloom.core.worker.ngram_proposer import NgramProposer

        proposer = NgramProposer(k, options["prompt_lookup_min"], options["prompt_lookup_max"])
    else:
        from kvloom.core.worker.draft_proposer import DraftModelProposer, DraftVocabularyError

        proposer = DraftModelProposer(k, options["draft_model"], options["draft_dtype"])
        try:
            proposer.check_vocabulary(hf_config)
        except (DraftVocabularyError, FileNotFoundError) as e:
            raise SpecDecodeOptionError(str(e)) from None
    proposer.policy = policy
    return proposer


def check_options(options: dict[str, Any]) -> None:
    """Raise SpecDecodeOptionError for values that cannot work, naming the value and the limit."""
    k = options["num_speculative_tokens"]
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpecDecodeOptionError(f"spec_decode num_speculative_tokens={k} must be in [1, {MAX_SPECULATIVE_TOKENS}]")
    lo, hi = options["prompt_lookup_min"], options["prompt_lookup_max"]
    if lo < 1 or hi < lo:
        raise SpecDecodeOptionError(f"spec_decode prompt_lookup_min={lo} and prompt_lookup_max={hi} must satisfy "
                                    "1 <= prompt_lookup_min <= prompt_lookup_max")
    if not 0.0 <= options["min_acceptance"] <= 1.0:
        raise SpecDecodeOptionError(f"spec_decode min_acceptance={options['min_acceptance']} must be in [0, 1]")
    if options["retry_after_steps"] < 1:
        raise SpecDecodeOptionError(f"spec_decode retry_after_steps={options['retry_after_steps']} must be >= 1")
    if options["max_batch_size"] < 0:
        raise SpecDecodeOptionError(f"spec_decode max_batch_size={options['max_batch_size']} must be >= 0")
    if options["method"] == "draft" and not options["draft_model"]:
        raise SpecDecodeOptionError("spec_decode method='draft' needs draft_model (a model path)")
    if options["method"] == "ngram":
        for name, default in (("draft_model", ""), ("draft_dtype", "auto")):
            if options[name] != default:
                raise SpecDecodeOptionError(f"spec_decode {name}={options[name]!r} cannot be used with method='ngram': "
                                            "it only applies to method='draft'")
