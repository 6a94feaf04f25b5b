"""`rlcli plan`: per-device memory of a composed config, estimated before anything is loaded, and the step time.

One module per job: shapes (the model's shape and parameter counts), states (bytes per parameter by precision
and ZeRO stage), activations (per token: activations, logits, KV cache), inputs (the longest prompt, the device),
estimate (the plan and the token budget), fixes (changes that fit), budget (the run-time budget fix), roofline
(the step time), report (the table, `rlcli train`'s check).

The formulas, their sources and the measured check are in docs/memory.md. In short, per device:

    model states   weights + gradients + optimizer states of the policy (and of the critic), per parameter
                   by precision, then divided by the data-parallel world size N_d where the ZeRO stage
                   partitions them (Rajbhandari et al. 2020, arXiv:1910.02054), or moved to host memory by
                   DeepSpeed's offload (hw.offload_optimizer, hw.offload_params)
    reference      a frozen copy of the policy's weights when algo.kl_coef > 0 (none with LoRA: the base model
                   with its adapters disabled is the reference)
    activations    what the backward pass keeps per layer (Korthikanti et al. 2022, arXiv:2205.05198, counted
                   for a Llama/Qwen2 block), or only each layer's input with gradient checkpointing
    logits         fp32 [rows, chunk, vocab] copies of the log-prob pass (hw.logits_chunk)
    rollout        rollout.engine=hf: the KV cache of one generate call, 2 x layers x kv_heads x head_dim x
                   bytes x rows x (prompt + max_new_tokens); rollout.engine=vllm: what the colocated engine
                   reserves, rollout.gpu_memory_utilization of the device (its weights and KV cache; on CPU
                   its copy of the weights + rollout.cpu_kv_cache_gb)

Generation and the update never run at once, so the peak is the model states plus the larger of the two
phases, max(activations + logits, rollout), except that a vLLM engine without rollout.sleep_mode keeps
its reservation through the update. Units: bytes inside, GiB (2^30 bytes) in every table.
"""
