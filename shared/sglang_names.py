"""Request field names of SGLang 0.5.23 (tests/SGLANG_VERSION), copied from its source: names only.

Used to check ``sampling.extra`` at config load. tests/test_sglang_conformance.py compares these
sets with the installed wheel, so a version bump that changes them fails there first.
"""

from __future__ import annotations

# The version these names were read from; tests/SGLANG_VERSION pins the wheel the conformance
# tests install (tests/test_sglang_rules.py checks the two agree). Named in config errors.
SGLANG_VERSION = "0.5.23"

# Keyword names of ``SamplingParams.__init__`` (srt/sampling/sampling_params.py, a msgspec
# Struct): what /generate turns ``sampling_params`` into. The last six are internal fields
# that __init__ accepts but that the HTTP contract gate refuses (see below).
GENERATE_SAMPLING_KEYS: frozenset[str] = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
    "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized", "ebnf_full_assistant",
})

# The keys /generate's JSON contract gate admits in ``sampling_params`` (sglang/api/v1/api_types.py,
# ``_FIELDS_SamplingParams``); any other key is a 400 before generation. A key is safe to send
# on /generate only if it is in both sets: GENERATE_SAMPLING_KEYS & GENERATE_CONTRACT_SAMPLING_KEYS.
GENERATE_CONTRACT_SAMPLING_KEYS: frozenset[str] = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
})

# Field names of ``ChatCompletionRequest`` (srt/entrypoints/openai/protocol.py, pydantic with the
# default extra="ignore": any other name in a chat body is dropped silently, not refused).
CHAT_REQUEST_KEYS: frozenset[str] = frozenset({
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "cache_salt", "chat_template_kwargs",
    "continue_final_message", "custom_logit_processor", "custom_params", "data_parallel_rank",
    "disagg_prefill_dp_rank", "ebnf", "extra_key", "frequency_penalty", "ignore_eos", "images_config", "input_ids",
    "logit_bias", "logprobs", "lora_path", "max_completion_tokens", "max_dynamic_patch", "max_tokens", "messages",
    "min_dynamic_patch", "min_p", "min_tokens", "mm_processor_kwargs", "model", "n", "no_stop_trim",
    "parallel_tool_calls", "presence_penalty", "priority", "reasoning_effort", "regex", "repetition_penalty",
    "response_format", "return_cached_tokens_details", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_input_ids_in_sglext", "return_meta_info",
    "return_output_ids_in_sglext", "return_prompt_token_ids", "return_routed_experts", "return_sampling_mask",
    "return_spec_tokens_details", "return_token_ids", "rid", "routed_dp_rank", "routed_experts_start_len",
    "sampling_logprobs_mode", "seed", "separate_reasoning", "session_id", "session_params", "skip_special_tokens",
    "stop", "stop_regex", "stop_token_ids", "stream", "stream_options", "stream_reasoning", "task", "temperature",
    "thinking", "tool_choice", "tools", "top_k", "top_logprobs", "top_p", "use_audio_in_video", "user",
    "video_config", "watermark",
})
