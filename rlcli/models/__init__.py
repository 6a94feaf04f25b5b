"""Models: loading policies and tokenizers and the log-prob pass (policy.py), which model a run trains and the
warm starts' cache (source.py, cache.py: torch-free), the embedded tiny model (tiny.py), the value model
(value.py), and their config schemas (config.py, torch-free). Attributes are imported on first use
(rlcli.core.lazy), so the schemas load without torch."""

from rlcli.core.lazy import exports

__all__ = ["DTYPES", "as_objects", "autocast", "eval_mode", "joint_inputs", "load_policy", "load_tokenizer",
           "logits_chunk_for", "resolve_model_path", "response_log_softmax", "response_logprobs", "response_outputs",
           "tokenizer_source", "warm_start_data", "with_lora"]
__getattr__ = exports(__name__, {**dict.fromkeys(__all__, "policy"), "tokenizer_source": "checks",
                                 **dict.fromkeys(("as_objects", "resolve_model_path", "warm_start_data"), "source")})
