"""Two ranks under torchrun: rank 0 trains (its policy has weights A), rank 1 generates (its module starts as B).
Rank 0 pushes A through rlcli.loop.remote; rank 1 checks its module now equals A bit for bit. Then a push
into a module the engine does not read (the sync "did not arrive" for the engine) must raise WeightSyncError.
Prints one line per check; tests/test_async.py runs it."""

import sys

import torch
from omegaconf import OmegaConf

from rlcli.loop.remote import Placement, WeightSyncError, join, push_weights, receive_weights
from rlcli.models.config import TinyModelConfig
from rlcli.models.tiny import build_tiny_model, build_tiny_tokenizer
from rlcli.rollout.hf import HFEngine

cfg = OmegaConf.create({"hw": {"collective_timeout_s": 60, "device": "cpu"}, "rollout": {"gen_batch_size": 8, "prefill_once": True}})
rank = int(__import__("os").environ["RANK"])
place = Placement(rank, 2, 1)
channel = join(cfg, place)
tokenizer = build_tiny_tokenizer()


def model(seed):
    return build_tiny_model(TinyModelConfig(), tokenizer, seed=seed)


if rank == 0:
    a = model(1)
    push_weights(channel, a, 1, place, torch.float32)
    with torch.no_grad():  # a second version, pushed to a rank whose engine reads another module
        next(a.parameters()).add_(1.0)
    push_weights(channel, a, 2, place, torch.float32)
    channel.flush()
else:
    b, stranger = model(2), model(3)
    assert not torch.equal(next(b.parameters()), next(model(1).parameters()))
    engine = HFEngine(b, None, None, OmegaConf.merge(cfg, {"hw": {"zero_stage": 0}}))
    assert receive_weights(channel, b, engine, check=True) == 1
    want = model(1).state_dict()
    print("equal:", all(torch.equal(t, want[k]) for k, t in b.state_dict().items()), flush=True)
    engine.model = stranger  # the engine no longer reads the module the weights arrive in
    try:
        receive_weights(channel, b, engine, check=True)
    except WeightSyncError as e:
        print("refused:", e, flush=True)
sys.exit(0)
