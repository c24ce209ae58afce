"""
Classic RLHF toy: PPO on GPT-2 (IMDB continuations) with a sentiment classifier as
the reward model, multi-GPU with DDP, tracked in Weights & Biases.

    torchrun --nproc_per_node=4 19_ppo_gpt2_imdb.py --run_name gpt2-imdb-ppo-4gpu
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--policy", default="lvwerra/gpt2-imdb")
parser.add_argument("--reward", default="lvwerra/distilbert-imdb")
parser.add_argument("--run_name", default="gpt2-imdb-ppo")
parser.add_argument("--batch_size", type=int, default=64)
parser.add_argument("--mini_batch_size", type=int, default=16)
parser.add_argument("--ppo_epochs", type=int, default=4)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--lr", type=float, default=1.41e-5)
parser.add_argument("--init_kl_coef", type=float, default=0.2)
parser.add_argument("--cliprange", type=float, default=0.2)
parser.add_argument("--vf_coef", type=float, default=0.1)
parser.add_argument("--gen_min", type=int, default=4)
parser.add_argument("--gen_max", type=int, default=16)
parser.add_argument("--save_dir", default="ckpt/gpt2-imdb-ppo")
parser.add_argument("--seed", type=int, default=0)


class GPT2WithValueHead(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.pretrained = AutoModelForCausalLM.from_pretrained(name)
        self.v_head = nn.Sequential(nn.Dropout(0.1), nn.Linear(self.pretrained.config.n_embd, 1))

    def forward(self, input_ids, attention_mask):
        out = self.pretrained(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.logits, self.v_head(out.hidden_states[-1]).squeeze(-1)


def build_imdb(tok):
    ds = load_dataset("stanfordnlp/imdb", split="train")
    ds = ds.rename_columns({"text": "review"}).filter(lambda x: len(x["review"]) > 200)
    return ds


def logprobs(logits, labels):
    return F.log_softmax(logits, dim=-1).gather(2, labels.unsqueeze(2)).squeeze(-1)


def main():
    args = parser.parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    wandb.init(project="rlhf-imdb", name=args.run_name, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.pad_token = tok.eos_token
    tok.padding_side = "left"

    policy = GPT2WithValueHead(args.policy).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.policy).to(device).eval()
    ref.requires_grad_(False)
    sent_tok = AutoTokenizer.from_pretrained(args.reward)
    sent = AutoModelForSequenceClassification.from_pretrained(args.reward).to(device).eval()
    sent.requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ds = build_imdb(tok)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: [x["review"] for x in b])
    kl_coef = args.init_kl_coef

    step, epoch, t0 = 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for reviews in loader:
            # random-length prompt prefix (2..8 tokens) from each review
            q_ids = [tok(r, add_special_tokens=False)["input_ids"][: random.randint(2, 8)] for r in reviews]
            enc = tok.pad({"input_ids": q_ids}, return_tensors="pt").to(device)
            P = enc.input_ids.size(1)
            gen_len = random.randint(args.gen_min, args.gen_max)

            with torch.no_grad():
                policy.eval()
                seq = policy.pretrained.generate(**enc, min_new_tokens=gen_len, max_new_tokens=gen_len,
                                                 do_sample=True, top_k=0, top_p=1.0, pad_token_id=tok.eos_token_id)
                resp = seq[:, P:]
                attn = torch.cat([enc.attention_mask, torch.ones_like(resp)], 1)
                logits, values = policy(seq, attn)
                old_lp = logprobs(logits[:, P - 1:-1], resp)
                values = values[:, P - 1:-1]
                ref_lp = logprobs(ref(input_ids=seq, attention_mask=attn).logits[:, P - 1:-1], resp)

                texts = tok.batch_decode(seq, skip_special_tokens=True)
                s_in = sent_tok(texts, return_tensors="pt", padding=True, truncation=True).to(device)
                score = sent(**s_in).logits[:, 1]  # positive-class logit

                kl = old_lp - ref_lp
                rewards = -kl_coef * kl
                rewards[:, -1] += score
                adv = torch.zeros_like(rewards)
                last = torch.zeros_like(score)
                for t in reversed(range(resp.size(1))):
                    nv = values[:, t + 1] if t + 1 < resp.size(1) else torch.zeros_like(last)
                    delta = rewards[:, t] + nv - values[:, t]
                    last = delta + 0.95 * last
                    adv[:, t] = last
                returns = adv + values
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                policy.train()

            for _ in range(args.ppo_epochs):
                for idx in torch.randperm(resp.size(0), device=device).split(args.mini_batch_size):
                    lg, v = model(seq[idx], attn[idx])
                    lp = logprobs(lg[:, P - 1:-1], resp[idx])
                    v = v[:, P - 1:-1]
                    ratio = torch.exp(lp - old_lp[idx])
                    pg = torch.max(-adv[idx] * ratio,
                                   -adv[idx] * ratio.clamp(1 - args.cliprange, 1 + args.cliprange)).mean()
                    vf = 0.5 * ((v - returns[idx]) ** 2).mean()
                    opt.zero_grad()
                    (pg + args.vf_coef * vf).backward()
                    opt.step()

            stats = torch.stack([score.mean(), kl.sum(1).mean(), pg.detach(), vf.detach()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            # proportional KL controller on the all-rank mean (target 6 nats)
            kl_coef *= 1 + float(np.clip(stats[1].item() / 6.0 - 1, -0.2, 0.2)) * args.batch_size * world / 10000
            step += 1

            wandb.log({"env/reward_mean": stats[0].item(), "objective/kl": stats[1].item(),
                       "ppo/policy_loss": stats[2].item(), "ppo/value_loss": stats[3].item(),
                       "objective/kl_coef": kl_coef, "time/elapsed": time.time() - t0}, step=step)
            if rank == 0 and step % 10 == 0:
                print(f"step {step} reward {stats[0]:.3f} kl {stats[1]:.3f} kl_coef {kl_coef:.4f}", flush=True)
            if step >= args.steps:
                break

    if rank == 0:
        policy.pretrained.save_pretrained(args.save_dir)
        tok.save_pretrained(args.save_dir)
    wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
