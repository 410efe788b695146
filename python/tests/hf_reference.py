"""transformers' own cache as the reference for ctxfs under a model: the same captured
prefix, its keys and values rounded to f16 as the store keeps them, and an attention that
rounds new tokens' keys and values the same way."""

import copy

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

F16_REFERENCE = "f16_reference"


def _f16_attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, key.half().float(), value.half().float(), attention_mask, **kwargs)


AttentionInterface.register(F16_REFERENCE, _f16_attention)
AttentionMaskInterface.register(F16_REFERENCE, AttentionMaskInterface._global_mapping["sdpa"])


def generate(model, prompt, cache, new_tokens, *, f16: bool):
    """Greedy generation after a captured prefix cache (copied, not changed), with its keys
    and values rounded to f16 when ``f16``."""
    cache = copy.deepcopy(cache)
    if f16:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.half().float(), layer.values.half().float()
    model.set_attn_implementation(F16_REFERENCE if f16 else "sdpa")
    return greedy(model, prompt, cache, new_tokens)


def through_ctxfs(model, prompt, cache, new_tokens):
    import ctxfs.hf

    ctxfs.hf.use_ctxfs(model)
    return greedy(model, prompt, cache, new_tokens)


def greedy(model, prompt, cache, new_tokens):
    """Exactly ``new_tokens`` greedy steps, with their logits."""
    return model.generate(
        prompt,
        cache=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def max_relative_logit_error(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.logits, b.logits))
