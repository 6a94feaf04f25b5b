"""The rollout engines by their `rollout.engine` name, and `build_engine` (the contract: rlcli/rollout/__init__.py)."""


from typing import Any

from rlcli.core import names
from rlcli.core.registry import Registry
from rlcli.rollout.hf import HFEngine
from rlcli.rollout.vllm import VLLMEngine

ROLLOUT_ENGINES = Registry(names.ROLLOUT_ENGINES)
ROLLOUT_ENGINES.register("hf")(HFEngine)
ROLLOUT_ENGINES.register("vllm")(VLLMEngine)


def build_engine(name: str, model: Any, tokenizer: Any, path: str, cfg: Any) -> Any:
    """The rollout engine `name` on `model`; multi-turn (rlcli.envs) when cfg.env.name is set, an agent's episodes
    through the gateway when cfg.rollout.agent is."""
    engine = ROLLOUT_ENGINES[name](model, tokenizer, path, cfg)
    if cfg.rollout.agent is not None:
        from rlcli.rollout.agent import AgentRollout

        return AgentRollout(engine, tokenizer, cfg)
    if cfg.env.name is None:
        return engine
    from rlcli.rollout.multiturn import MultiTurn

    return MultiTurn(engine, tokenizer, cfg.env)
