"""What a plan reads besides the config's numbers: the longest prompt (bounded from the config, or measured on the
data with the run's tokenizer) and the device's memory."""

from __future__ import annotations

from typing import Any

from rlcli.plan.states import GIB


def prompt_tokens(cfg: Any) -> tuple[int, str]:
    """Longest prompt, in tokens: data.max_prompt_len bounds it (longer prompts are dropped); the embedded arith
    task with its character tokenizer and the plain template has an exact, smaller bound."""
    return arith_bound(cfg) or (cfg.data.max_prompt_len,
                                "data.max_prompt_len, a bound: `rlcli train` measures the data's longest prompt")


def arith_bound(cfg: Any) -> tuple[int, str] | None:
    """The embedded arith task's longest prompt on the tiny model (1 character = 1 token, the plain template, no
    multi-turn environment): the prompt of operands with data.max_digits digits, a bound that any such problem
    reaches (tests/test_plan.py checks it against the tokenized data). None for any other set-up."""
    d = cfg.data
    tiny = cfg.model.path is None and cfg.model.gguf_file is None
    if not (d.source == "arith" and tiny and d.template == "question" and d.chat != "always" and cfg.env.name is None):
        return None
    from rlcli.data.arith import make_example

    longest = 10**d.max_digits - 1
    n = max(len(make_example(longest, longest, op)["prompt"]) for op in "+-")
    return min(n, d.max_prompt_len), "arith prompt at data.max_digits (1 char = 1 token)"


def longest_prompt(tokenizer: Any, examples: list[dict[str, str]], env: Any = None) -> tuple[int, str]:
    """The longest of `examples`' prompts in tokens, encoded as the rollout engines encode them
    (rlcli.rollout.hf.encode_prompts: no special tokens added; a chat template is already rendered). With a
    multi-turn `env` (the config's env group), as the environment's chat template renders them (rlcli.envs)."""
    prompts = [e["prompt"] for e in examples]
    if env is not None and env.name is not None:
        from rlcli.envs.env import rendered_prompts

        prompts = rendered_prompts(tokenizer, env, prompts)
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    return max(lengths), f"measured: the longest of {len(lengths)} train and eval prompts"


def measure_prompts(cfg: Any) -> tuple[int, str]:
    """longest_prompt over the run's train and eval splits, read as the trainer reads them (template, chat
    template, data.max_prompt_len filter) with the run's tokenizer; no weights are loaded (a GGUF file is
    converted first: its tokenizer lives in the conversion). The embedded arith task on the tiny model needs no
    reading (arith_bound): the start of a default run then loads no tokenizer before its workers do."""
    exact = arith_bound(cfg)
    if exact is not None:
        return exact
    import logging

    from rlcli.data import load_split
    from rlcli.models import load_tokenizer, tokenizer_source

    tokenizer = load_tokenizer(tokenizer_source(cfg.model), cfg.model.trust_remote_code)
    logging.disable(logging.WARNING)  # the trainer reports the load (kept, dropped, bad rows) when it reads it
    try:
        examples = [e for split in ("train", "eval") for e in load_split(cfg.data, split, cfg.seed, tokenizer=tokenizer, env_cfg=cfg.env)[0]]
    finally:
        logging.disable(logging.NOTSET)
    return longest_prompt(tokenizer, examples, cfg.env)


def device_memory(hw: Any) -> tuple[float | None, str]:
    """(bytes per device or None, where the number comes from)."""
    if hw.device_memory_gb is not None:
        return hw.device_memory_gb * GIB, "hw.device_memory_gb"
    if hw.device == "cpu":
        import psutil

        ram = psutil.virtual_memory().total
        return ram / hw.nproc, f"RAM {ram / GIB:.1f} GiB (psutil) / hw.nproc={hw.nproc} ranks"
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), f"torch.cuda: {torch.cuda.get_device_name(0)}"
    return None, "unknown: no CUDA device here; set hw.device_memory_gb"
