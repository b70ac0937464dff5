"""What a converted model must offer the service once it is turned into a paged-attention model.

Plain constants, no imports: the service may import this module without pulling in the converter's libraries.
"""

# Inputs of the IR after `paged_attention_transformation(model, False, False)`, besides one
# key_cache.N / value_cache.N pair per decoder layer (KV_CACHE_PREFIXES).
PAGED_ATTENTION_INPUTS = (
    "input_ids",
    "position_ids",
    "max_context_len",
    "past_lens",
    "subsequence_begins",
    "block_indices_begins",
    "block_indices",
)
KV_CACHE_PREFIXES = ("key_cache.", "value_cache.")
