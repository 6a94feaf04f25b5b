"""An independent, minimal GRPO loop in plain PyTorch (no rlcli trainer, no DeepSpeed).

It exists to answer one question: does the tiny arith task fail to improve under RL because of
rlcli's trainer, or because of the task and the warm start? It shares only the task generator,
the tokenizer and the accuracy probe with rlcli. Group-normalised advantages, one on-policy
update per step (ratio 1), per-sequence token-mean loss, AdamW, grad-norm clip 1.0, no KL.
`--neg` scales negative advantages (1 = GRPO, 0 = positive examples only).

    python docs/experiments/plain_grpo.py <warm-start dir> --lr 1e-4 --steps 40

Measured results are in README.md ("What we measured about learning").
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from rlcli.data.arith import arith_examples, is_correct
from rlcli.models.tiny import load_tiny_tokenizer
from rlcli.models.sft import greedy_accuracy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("path", help="a warm-started tiny model directory (rlcli sft output)")
parser.add_argument("--lr", type=float, default=1e-4)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--neg", type=float, default=1.0, help="scale of negative advantages")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--group", type=int, default=8)
parser.add_argument("--min-digits", type=int, default=2)
parser.add_argument("--max-digits", type=int, default=3)
args = parser.parse_args()

torch.manual_seed(1)
tok = load_tiny_tokenizer()
model = AutoModelForCausalLM.from_pretrained(args.path)
digits = dict(min_digits=args.min_digits, max_digits=args.max_digits)
train = arith_examples("train", args.steps * args.prompts, 1, **digits)
evals = arith_examples("eval", 200, 0, **digits)
print("held-out greedy before", greedy_accuracy(model, tok, evals, 48), flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
P, G = args.prompts, args.group
for step in range(args.steps):
    batch = train[step * P : (step + 1) * P]
    enc = tok([e["prompt"] for e in batch], add_special_tokens=False, padding=True,
              padding_side="left", return_tensors="pt")
    ids = enc["input_ids"].repeat_interleave(G, 0)  # [P*G, Tp]
    am = enc["attention_mask"].repeat_interleave(G, 0)  # [P*G, Tp]
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=48, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    resp = out[:, ids.shape[1] :]  # [P*G, T]
    is_eos = resp == tok.eos_token_id
    rmask = ((is_eos.cumsum(-1) - is_eos.long()) == 0).float()  # up to and including the first EOS
    texts = [tok.decode(r[: int(m.sum())], skip_special_tokens=True) for r, m in zip(resp, rmask)]
    answers = [e["answer"] for e in batch for _ in range(G)]
    reward = torch.tensor([float(is_correct(t, a)) for t, a in zip(texts, answers)])  # [P*G]
    r = reward.view(P, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)  # [P*G]
    adv = torch.where(adv < 0, adv * args.neg, adv)
    full = torch.cat([ids, resp], 1)
    full_mask = torch.cat([am.float(), rmask], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0).long()  # left padding: positions from the mask
    model.train()
    logits = model(input_ids=full, attention_mask=full_mask.long(), position_ids=pos).logits
    logits = logits[:, ids.shape[1] - 1 : -1]  # [P*G, T, V] predicting each response token
    logp = torch.log_softmax(logits.float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    loss = -((adv[:, None] * logp * rmask).sum(1) / rmask.sum(1)).mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    print(f"step {step + 1} sampled acc {reward.mean():.3f} grad_norm {grad_norm:.3f}", flush=True)
print("held-out greedy after", greedy_accuracy(model, tok, evals, 48), flush=True)
