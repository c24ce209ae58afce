"""Hand-rolled PPO-RLHF (policy + value head, frozen reference, frozen reward model).

    torchrun --nproc_per_node=8 12_ppo_rlhf_main.py --sft ckpt/sft-1.4b --rm ckpt/rm-1.4b \
        --prompts data/hh_prompts.jsonl --eval_prompts data/hh_prompts_eval.jsonl --wandb
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

try:
    import wandb
except ImportError:
    wandb = None


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft", required=True)
    ap.add_argument("--rm", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--eval_prompts", required=True)
    ap.add_argument("--out", default="ckpt/ppo")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--minibatch", type=int, default=4)
    ap.add_argument("--ppo_epochs", type=int, default=4)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--gen_tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--init_kl", type=float, default=0.1)
    ap.add_argument("--target_kl", type=float, default=6.0)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--vf_coef", type=float, default=0.1)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


class PolicyWithValue(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.v = nn.Linear(self.lm.config.hidden_size, 1)
        nn.init.normal_(self.v.weight, std=0.01)
        nn.init.zeros_(self.v.bias)

    def forward(self, ids, attn):
        o = self.lm(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        return o.logits, self.v(o.hidden_states[-1].float()).squeeze(-1)


class AdaptiveKL:
    """Ziegler et al. adaptive KL controller; fed with the KL averaged over all ranks."""

    def __init__(self, init, target, horizon=10000):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl, n):
        err = float(np.clip(kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + err * n / self.horizon


def lp(logits, tok):
    return F.log_softmax(logits.float(), -1).gather(-1, tok[..., None]).squeeze(-1)


def response_mask(resp, eos_id):
    eos = resp == eos_id
    end = torch.where(eos.any(1), eos.int().argmax(1), torch.full_like(resp[:, 0], resp.size(1) - 1))
    return (torch.arange(resp.size(1), device=resp.device)[None] <= end[:, None]).long(), end


def pad_to(t, length, value):
    return F.pad(t, (0, length - t.size(1)), value=value) if t.size(1) < length else t


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    # per-rank seeds so the ranks sample different responses; DDP broadcasts rank 0's weights
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    tok = AutoTokenizer.from_pretrained(args.sft, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    eos_id = tok.eos_token_id

    policy = PolicyWithValue(args.sft).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.sft, torch_dtype=torch.bfloat16).to(dev).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(args.rm, num_labels=1, torch_dtype=torch.bfloat16)
    rm = rm.to(dev).eval()
    ref.requires_grad_(False)
    rm.requires_grad_(False)

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, eps=1e-5)
    kl_ctl = AdaptiveKL(args.init_kl, args.target_kl)
    start_it = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        policy.load_state_dict(ck["policy"])
        opt.load_state_dict(ck["opt"])
        kl_ctl.value = ck["kl_coef"]
        start_it = ck["iter"]
    model = DDP(policy, device_ids=[local_rank], output_device=local_rank)

    with open(args.prompts) as f:
        prompts = [json.loads(l)["prompt"] for l in f]
    with open(args.eval_prompts) as f:
        eval_prompts = [json.loads(l)["prompt"] for l in f]
    sampler = DistributedSampler(prompts, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(prompts, batch_size=args.batch, sampler=sampler, drop_last=True)

    run = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        if args.wandb and wandb is not None:
            run = wandb.init(project="ppo-rlhf", config=vars(args), resume="allow")

    @torch.no_grad()
    def score(seq, attn):
        return rm(input_ids=seq, attention_mask=attn).logits[:, 0].float()

    @torch.no_grad()
    def win_rate_and_samples():
        policy.eval()
        mine = eval_prompts[rank::world]
        wins = torch.zeros(2, device=dev)
        shown = None
        for i in range(0, len(mine), args.batch):
            enc = tok(mine[i:i + args.batch], return_tensors="pt", padding=True).to(dev)
            P = enc.input_ids.size(1)
            outs = []
            for m in (policy.lm, ref):
                s = m.generate(**enc, max_new_tokens=args.gen_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
                rmask, _ = response_mask(s[:, P:], eos_id)
                outs.append((s, torch.cat([enc.attention_mask, rmask], 1)))
            r_pol, r_ref = score(*outs[0]), score(*outs[1])
            wins[0] += (r_pol > r_ref).sum()
            wins[1] += r_pol.numel()
            if shown is None:
                shown = outs[0][0][:2, P:]
        dist.all_reduce(wins)
        # equal shapes for all_gather: pad every rank's samples to the longest one
        if shown is None:
            shown = torch.full((2, 1), tok.pad_token_id, dtype=torch.long, device=dev)
        length = torch.tensor([shown.size(1)], device=dev)
        dist.all_reduce(length, op=dist.ReduceOp.MAX)
        shown = pad_to(shown, int(length.item()), tok.pad_token_id)
        if shown.size(0) < 2:
            shown = torch.cat([shown, torch.full_like(shown[:1], tok.pad_token_id)], 0)
        bucket = [torch.empty_like(shown) for _ in range(world)]
        dist.all_gather(bucket, shown)
        policy.train()
        texts = [tok.decode(t, skip_special_tokens=True) for t in torch.cat(bucket)]
        return (wins[0] / wins[1].clamp_min(1)).item(), texts

    it, epoch, t0 = start_it, 0, time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        epoch += 1
        for batch_prompts in loader:
            enc = tok(list(batch_prompts), return_tensors="pt", padding=True, truncation=True, max_length=384).to(dev)
            P = enc.input_ids.size(1)
            with torch.no_grad():
                policy.eval()
                seq = policy.lm.generate(**enc, max_new_tokens=args.gen_tokens, do_sample=True, top_k=0,
                                         top_p=1.0, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                rmask, end = response_mask(resp, eos_id)
                attn = torch.cat([enc.attention_mask, rmask], 1)
                logits, values = policy(seq, attn)
                old_lp = lp(logits[:, P - 1:-1], resp)
                ref_lp = lp(ref(input_ids=seq, attention_mask=attn).logits[:, P - 1:-1], resp)
                m = rmask.float()
                values = values[:, P - 1:-1] * m
                kl = (old_lp - ref_lp) * m
                scores = score(seq, attn)
                rewards = -kl_ctl.value * kl
                rewards[torch.arange(resp.size(0), device=dev), end] += scores
                adv = torch.zeros_like(rewards)
                running = torch.zeros_like(scores)
                for t in reversed(range(resp.size(1))):
                    nv = values[:, t + 1] if t + 1 < resp.size(1) else torch.zeros_like(running)
                    running = rewards[:, t] + nv - values[:, t] + 0.95 * running
                    adv[:, t] = running
                returns = adv + values
                mu = (adv * m).sum() / m.sum()
                var = (((adv - mu) ** 2) * m).sum() / m.sum()
                adv = (adv - mu) * torch.rsqrt(var + 1e-8) * m
                policy.train()

            for _ in range(args.ppo_epochs):
                for idx in torch.randperm(resp.size(0), device=dev).split(args.minibatch):
                    lg, v = model(seq[idx], attn[idx])
                    new_lp = lp(lg[:, P - 1:-1], resp[idx])
                    ratio = (new_lp - old_lp[idx]).exp()
                    mm = m[idx]
                    pg = torch.max(-adv[idx] * ratio, -adv[idx] * ratio.clamp(1 - args.clip, 1 + args.clip))
                    pg_loss = (pg * mm).sum() / mm.sum()
                    vf_loss = 0.5 * (((v[:, P - 1:-1] - returns[idx]) ** 2) * mm).sum() / mm.sum()
                    opt.zero_grad(set_to_none=True)
                    (pg_loss + args.vf_coef * vf_loss).backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()

            stats = torch.stack([kl.sum(1).mean(), scores.mean(), m.sum(1).mean(), pg_loss.detach(), vf_loss.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            kl_ctl.update(stats[0].item(), args.batch * world)
            it += 1
            if rank == 0:
                log = dict(kl=stats[0].item(), score=stats[1].item(), resp_len=stats[2].item(),
                           pg_loss=stats[3].item(), vf_loss=stats[4].item(), kl_coef=kl_ctl.value)
                if it % 10 == 0:
                    print(f"it {it} " + " ".join(f"{k}={v:.4f}" for k, v in log.items())
                          + f" {time.time() - t0:.0f}s", flush=True)
                if run is not None:
                    run.log(log, step=it)

            if it % args.eval_every == 0:
                wr, texts = win_rate_and_samples()
                if rank == 0:
                    print(f"it {it} win rate vs SFT: {wr:.3f}", flush=True)
                    if run is not None:
                        run.log({"eval/win_rate": wr,
                                 "eval/samples": wandb.Table(columns=["text"], data=[[t] for t in texts])}, step=it)
                    torch.save({"policy": policy.state_dict(), "opt": opt.state_dict(), "kl_coef": kl_ctl.value,
                                "iter": it}, os.path.join(args.out, "last.pt"))
                dist.barrier()
            if it >= args.iters:
                break

    if rank == 0:
        policy.lm.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
        if run is not None:
            run.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
