"""Gemma 3 text: Gemma 2's layout with (1 + w) RMSNorm of q and k, local (sliding) and global layers (five
to one by default) each with its own rotary base, and no soft-capping unless the config sets it. Also the
text part of ``Gemma3ForConditionalGeneration`` checkpoints: the vision tower and projector are skipped."""

from __future__ import annotations

import dataclasses
import logging

from kvloom.core.model.families import register
from kvloom.core.model.families.decoder import AttentionSpec
from kvloom.core.model.families.gemma2 import Gemma2ForCausalLM

logger = logging.getLogger("kvloom")

_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_TEXT = (("language_model.model.", "model."), ("model.language_model.", "model."),
         ("language_model.lm_head.", "lm_head."))


@register("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    @classmethod
    def decoder_config(cls, config):
        """The text model's config of a multimodal checkpoint (its architecture kept, so the weights map)."""
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        text.architectures = list(config.architectures)
        for key in ("eos_token_id", "bos_token_id", "quantization_config"):
            if getattr(config, key, None) is not None:
                setattr(text, key, getattr(config, key))
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
        return text

    @classmethod
    def attention_spec(cls, config, layer_idx: int) -> AttentionSpec:
        spec = super().attention_spec(config, layer_idx)
        params = getattr(config, "rope_parameters", None) or {}
        layer_type = config.layer_types[layer_idx]
        return dataclasses.replace(spec, rope=layer_type if isinstance(params.get(layer_type), dict) else None)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION):
            self.skipped_vision_tensors = getattr(self, "skipped_vision_tensors", 0) + 1
            if self.skipped_vision_tensors == 1:
                logger.info("Gemma 3: serving the text model; the checkpoint's vision tower and projector "
                            "are skipped (image inputs are not supported)")
            return None
        for prefix, replacement in _TEXT:
            if name.startswith(prefix):
                return replacement + name[len(prefix):]
        return name
