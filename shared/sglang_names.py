"""Request field names SGLang 0.5.23 accepts, per API (names only, read from its source).

- ``GENERATE_SAMPLING_KEYS``: the API fields of ``SamplingParams``
  (python/sglang/srt/sampling/sampling_params.py), the keys of ``/generate``'s
  ``sampling_params``. Any other key is a 400 for every request.
- ``CHAT_REQUEST_KEYS``: the fields of ``ChatCompletionRequest``
  (python/sglang/srt/entrypoints/openai/protocol.py). Unknown keys are ignored by the server,
  so a misspelt option would silently do nothing.

tests/test_sglang_conformance.py compares both sets with the installed sglang wheel, so a new
SGLang release that renames a field shows up as a failing test.
"""

SGLANG_VERSION = "0.5.23"

GENERATE_SAMPLING_KEYS: frozenset[str] = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
})

CHAT_REQUEST_KEYS: frozenset[str] = frozenset({
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "user", "tools", "tool_choice", "parallel_tool_calls",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_cached_tokens_details",
    "return_spec_tokens_details", "return_prompt_token_ids", "return_token_ids", "return_meta_info",
    "return_input_ids_in_sglext", "return_output_ids_in_sglext", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "reasoning_effort", "thinking",
    "task", "top_k", "min_p", "min_tokens", "regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex",
    "no_stop_trim", "ignore_eos", "continue_final_message", "skip_special_tokens", "lora_path", "session_id",
    "session_params", "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "images_config", "video_config", "mm_processor_kwargs",
    "custom_logit_processor", "custom_params", "watermark", "input_ids", "rid", "extra_key", "cache_salt",
    "priority", "data_parallel_rank",
    # PDRoutingFields (the base class): prefill/decode disaggregation routing.
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank",
})
