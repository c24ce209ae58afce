"""
PPO on IMDB: make gpt2-imdb continue movie reviews with positive sentiment,
scored by a DistilBERT sentiment classifier. Separate actor and critic
networks (both DDP), frozen reference actor, per-token KL penalty, GAE.

    torchrun --standalone --nproc_per_node=4 13_ppo_imdb_sentiment.py --wandb_project ppo-imdb
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
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline


def get_config():
    p = argparse.ArgumentParser()
    p.add_argument("--actor", default="lvwerra/gpt2-imdb")
    p.add_argument("--sentiment_model", default="lvwerra/distilbert-imdb")
    p.add_argument("--wandb_project", default="ppo-imdb")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--mini_batch_size", type=int, default=16)
    p.add_argument("--ppo_epochs", type=int, default=4)
    p.add_argument("--gen_len", type=int, default=24)
    p.add_argument("--actor_lr", type=float, default=1.4e-5)
    p.add_argument("--critic_lr", type=float, default=5e-5)
    p.add_argument("--init_kl_coef", type=float, default=0.2)
    p.add_argument("--cliprange", type=float, default=0.2)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save_dir", default="ckpt/ppo_imdb")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Critic(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.body = AutoModel.from_pretrained(name)
        self.v = nn.Linear(self.body.config.n_embd, 1)

    def forward(self, ids, attn):
        h = self.body(input_ids=ids, attention_mask=attn).last_hidden_state
        return self.v(h).squeeze(-1)


def logprobs_of(logits, labels):
    return torch.gather(F.log_softmax(logits, -1), 2, labels.unsqueeze(-1)).squeeze(-1)


def set_seed(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def main():
    cfg = get_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=cfg.wandb_project, config=vars(cfg), name=f"ppo-imdb-{world}gpu")

    set_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(cfg.actor, padding_side="left")
    tok.pad_token = tok.eos_token
    actor = AutoModelForCausalLM.from_pretrained(cfg.actor).to(device)
    ref_actor = AutoModelForCausalLM.from_pretrained(cfg.actor).to(device).eval().requires_grad_(False)
    critic = Critic(cfg.actor).to(device)
    actor = DDP(actor, device_ids=[local_rank])
    critic = DDP(critic, device_ids=[local_rank])
    set_seed(cfg.seed + rank)

    sentiment = pipeline("sentiment-analysis", model=cfg.sentiment_model, device=local_rank)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=cfg.actor_lr)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr)

    ds = load_dataset("stanfordnlp/imdb", split="train")
    ds = ds.filter(lambda x: len(x["text"]) > 200)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    # queries are the first 2-8 words of a review, drawn fresh every time a batch is built
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler,
                        collate_fn=lambda b: [" ".join(x["text"].split()[: random.randint(2, 8)]) for x in b])

    kl_coef = cfg.init_kl_coef
    step = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        for queries in loader:
            t0 = time.time()
            enc = tok(queries, return_tensors="pt", padding=True).to(device)
            Q = enc.input_ids.shape[1]
            with torch.no_grad():
                seq = actor.module.generate(**enc, do_sample=True, top_k=0, top_p=1.0,
                                            max_new_tokens=cfg.gen_len, min_new_tokens=cfg.gen_len,
                                            pad_token_id=tok.eos_token_id)
                resp = seq[:, Q:]
                attn = torch.cat([enc.attention_mask, torch.ones_like(resp)], 1)
                texts = tok.batch_decode(seq, skip_special_tokens=True)
                outs = sentiment(texts, top_k=None, function_to_apply="none", batch_size=cfg.batch_size)
                scores = torch.tensor([next(o["score"] for o in out if o["label"] == "POSITIVE") for out in outs],
                                      device=device)

                old_lp = logprobs_of(actor(seq, attention_mask=attn).logits[:, Q - 1:-1], resp)
                ref_lp = logprobs_of(ref_actor(seq, attention_mask=attn).logits[:, Q - 1:-1], resp)
                values = critic(seq, attn)[:, Q - 1:-1]

                kl = old_lp - ref_lp
                rewards = -kl_coef * kl
                rewards[:, -1] += scores
                adv = torch.zeros_like(rewards)
                gae = torch.zeros(rewards.shape[0], device=device)
                for t in reversed(range(rewards.shape[1])):
                    next_v = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
                    delta = rewards[:, t] + cfg.gamma * next_v - values[:, t]
                    gae = delta + cfg.gamma * cfg.lam * gae
                    adv[:, t] = gae
                returns = adv + values
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)

            pg_losses, v_losses, clipfracs = [], [], []
            for _ in range(cfg.ppo_epochs):
                for idx in torch.randperm(seq.shape[0], device=device).split(cfg.mini_batch_size):
                    lp = logprobs_of(actor(seq[idx], attention_mask=attn[idx]).logits[:, Q - 1:-1], resp[idx])
                    ratio = (lp - old_lp[idx]).exp()
                    pg = torch.max(-adv[idx] * ratio, -adv[idx] * ratio.clamp(1 - cfg.cliprange, 1 + cfg.cliprange))
                    pg_loss = pg.mean()
                    actor_opt.zero_grad(set_to_none=True)
                    pg_loss.backward()
                    torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
                    actor_opt.step()

                    v = critic(seq[idx], attn[idx])[:, Q - 1:-1]
                    v_loss = 0.5 * ((v - returns[idx]) ** 2).mean()
                    critic_opt.zero_grad(set_to_none=True)
                    v_loss.backward()
                    critic_opt.step()

                    pg_losses.append(pg_loss.detach())
                    v_losses.append(v_loss.detach())
                    clipfracs.append(((ratio - 1).abs() > cfg.cliprange).float().mean())

            stats = torch.stack([scores.mean(), kl.sum(1).mean(), torch.stack(pg_losses).mean(),
                                 torch.stack(v_losses).mean(), torch.stack(clipfracs).mean()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            mean_score, mean_kl, pgl, vl, cf = stats.tolist()
            # adaptive KL controller (target 6 nats), identical on all ranks since mean_kl is reduced
            kl_coef *= 1 + 0.1 * float(np.clip(mean_kl / 6.0 - 1, -0.2, 0.2)) * cfg.batch_size * world / 10000
            step += 1
            wandb.log({"env/reward_mean": mean_score, "objective/kl": mean_kl, "objective/kl_coef": kl_coef,
                       "ppo/loss/policy": pgl, "ppo/loss/value": vl, "ppo/clipfrac": cf,
                       "time/step": time.time() - t0}, step=step)
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step} reward {mean_score:.3f} kl {mean_kl:.2f} coef {kl_coef:.3f}", flush=True)

        if rank == 0:
            out = os.path.join(cfg.save_dir, f"epoch{epoch}")
            actor.module.save_pretrained(out)
            tok.save_pretrained(out)
            torch.save(critic.module.state_dict(), os.path.join(out, "critic.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
