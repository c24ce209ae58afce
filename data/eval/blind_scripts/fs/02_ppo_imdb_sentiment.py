"""PPO on IMDB prompts: make GPT-2 continue movie reviews with positive sentiment.

Actor and critic share the GPT-2 trunk; the reward is the logit of the POSITIVE
class of a DistilBERT sentiment classifier. Per-token KL to the frozen SFT model
is folded into the reward, advantages from GAE.
"""
import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer)


class PolicyWithValue(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(name)
        self.v_head = nn.Linear(self.lm.config.n_embd, 1)
        nn.init.zeros_(self.v_head.bias)
        nn.init.normal_(self.v_head.weight, std=1e-3)

    def forward(self, input_ids, attention_mask):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        values = self.v_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, values

    def generate(self, **kw):
        return self.lm.generate(**kw)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="lvwerra/gpt2-imdb")
    ap.add_argument("--reward_model", default="lvwerra/distilbert-imdb")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--mini_batch", type=int, default=8)
    ap.add_argument("--ppo_epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.41e-5)
    ap.add_argument("--init_kl", type=float, default=0.2)
    ap.add_argument("--gamma", type=float, default=1.0)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--cliprange", type=float, default=0.2)
    ap.add_argument("--cliprange_value", type=float, default=0.2)
    ap.add_argument("--vf_coef", type=float, default=0.1)
    ap.add_argument("--gen_len", type=int, default=24)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="checkpoints/ppo_imdb")
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local_rank}")


def logprobs_from_logits(logits, labels):
    logp = torch.log_softmax(logits, dim=-1)
    return torch.gather(logp, 2, labels.unsqueeze(-1)).squeeze(-1)


def whiten(x, mask, shift_mean=True):
    mean = (x * mask).sum() / mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / mask.sum()
    w = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        w = w + mean
    return w


def compute_gae(rewards, values, mask, gamma, lam):
    T = rewards.size(1)
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.size(0), device=rewards.device)
    for t in reversed(range(T)):
        nxt = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    returns = adv + values
    adv = whiten(adv, mask)
    return adv.detach(), returns.detach()


def main():
    args = get_args()
    rank, world, device = setup()
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"

    policy = PolicyWithValue(args.policy).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.policy).to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    rm_tok = AutoTokenizer.from_pretrained(args.reward_model)
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward_model).to(device).eval()

    policy = DDP(policy, device_ids=[device.index])
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)

    ds = load_dataset("stanfordnlp/imdb", split="train")
    ds = ds.filter(lambda x: len(x["text"]) > 200)
    qrng = random.Random(args.seed)  # same query lengths on every rank
    ds = ds.map(lambda x: {"query": " ".join(x["text"].split()[: qrng.randint(2, 8)])})
    ds = ds.remove_columns([c for c in ds.column_names if c != "query"])
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: [x["query"] for x in b])

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    kl_coef = args.init_kl
    step, epoch = 0, 0
    it = iter(loader)
    while step < args.steps:
        try:
            queries = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            queries = next(it)

        # ---------------- rollout ----------------
        enc = tok(queries, return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            seq = policy.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                                  do_sample=True, top_k=0, top_p=1.0, max_new_tokens=args.gen_len,
                                  min_new_tokens=args.gen_len, pad_token_id=tok.eos_token_id)
            P = enc.input_ids.size(1)
            resp = seq[:, P:]
            attn = torch.cat([enc.attention_mask, torch.ones_like(resp)], dim=1)
            logits, values = policy(seq, attn)
            old_logp = logprobs_from_logits(logits[:, P - 1:-1].float(), resp)
            old_values = values[:, P - 1:-1].float()
            ref_logits = ref(input_ids=seq, attention_mask=attn).logits
            ref_logp = logprobs_from_logits(ref_logits[:, P - 1:-1].float(), resp)

            texts = [q + r for q, r in zip(queries, tok.batch_decode(resp, skip_special_tokens=True))]
            rm_in = rm_tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=512).to(device)
            scores = rm(**rm_in).logits[:, 1]

            kl = old_logp - ref_logp
            rewards = -kl_coef * kl
            rewards[:, -1] += scores
            mask = torch.ones_like(rewards)
            adv, returns = compute_gae(rewards, old_values, mask, args.gamma, args.lam)

        # ---------------- optimisation ----------------
        n = seq.size(0)
        for _ in range(args.ppo_epochs):
            for idx in torch.randperm(n, device=device).split(args.mini_batch):
                logits, vpred = policy(seq[idx], attn[idx])
                lp = logprobs_from_logits(logits[:, P - 1:-1].float(), resp[idx])
                vpred = vpred[:, P - 1:-1].float()
                ratio = torch.exp(lp - old_logp[idx])
                pg = torch.max(-adv[idx] * ratio,
                               -adv[idx] * ratio.clamp(1 - args.cliprange, 1 + args.cliprange)).mean()
                v_clip = old_values[idx] + (vpred - old_values[idx]).clamp(-args.cliprange_value, args.cliprange_value)
                vf = 0.5 * torch.max((vpred - returns[idx]) ** 2, (v_clip - returns[idx]) ** 2).mean()
                loss = pg + args.vf_coef * vf
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()

        # adaptive KL controller on the global mean KL
        stats = torch.stack([scores.mean(), kl.sum(1).mean()]).detach()
        dist.all_reduce(stats, op=dist.ReduceOp.AVG)
        mean_score, mean_kl = stats.tolist()
        proportional_error = max(min(mean_kl / 6.0 - 1, 0.2), -0.2)
        kl_coef *= 1 + proportional_error * n * world / 10000
        step += 1

        if rank == 0:
            writer.add_scalar("env/reward_mean", mean_score, step)
            writer.add_scalar("objective/kl", mean_kl, step)
            writer.add_scalar("objective/kl_coef", kl_coef, step)
            if step % 20 == 0:
                print(f"step {step} reward {mean_score:.3f} kl {mean_kl:.3f} | {texts[0]!r}")
        if step % 100 == 0 and rank == 0:
            path = os.path.join(args.out, f"step{step}")
            policy.module.lm.save_pretrained(path)
            tok.save_pretrained(path)
            torch.save(policy.module.v_head.state_dict(), os.path.join(path, "v_head.pt"))

    dist.barrier()
    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
