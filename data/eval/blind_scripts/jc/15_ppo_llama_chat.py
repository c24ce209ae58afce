"""
PPO-RLHF for a Llama-3.2-1B chat policy.

  * actor + critic: trained, DDP
  * reference policy: frozen SFT model for the KL term
  * reward model: frozen, trained earlier with rm_train.py

torchrun --standalone --nproc_per_node=4 15_ppo_llama_chat.py --sft ckpt/llama1b-sft --rm ckpt/llama1b-rm
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft", required=True)
    ap.add_argument("--rm", required=True)
    ap.add_argument("--dataset", default="HuggingFaceH4/ultrachat_200k")
    ap.add_argument("--out", default="ckpt/llama1b-ppo")
    ap.add_argument("--rollouts_per_gpu", type=int, default=32)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--ppo_epochs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--max_new", type=int, default=256)
    ap.add_argument("--actor_lr", type=float, default=5e-7)
    ap.add_argument("--critic_lr", type=float, default=9e-6)
    ap.add_argument("--kl", type=float, default=0.02)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


class Critic(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.body = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).model
        self.head = nn.Linear(self.body.config.hidden_size, 1, dtype=torch.bfloat16)

    def forward(self, ids, attn):
        return self.head(self.body(input_ids=ids, attention_mask=attn).last_hidden_state).squeeze(-1).float()


class ActorCritic(nn.Module):
    """One DDP module so both parts share a single reducer / backward."""

    def __init__(self, path):
        super().__init__()
        self.actor = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.critic = Critic(path)

    def forward(self, ids, attn):
        return self.actor(input_ids=ids, attention_mask=attn).logits, self.critic(ids, attn)


def token_lp(logits, ids):
    return F.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def main():
    a = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(a.seed)

    tok = AutoTokenizer.from_pretrained(a.sft)
    tok.padding_side = "left"
    tok.pad_token = "<|finetune_right_pad_id|>"
    eos_ids = [tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")]

    ac = ActorCritic(a.sft).to(dev)
    model = DDP(ac, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": ac.actor.parameters(), "lr": a.actor_lr},
        {"params": ac.critic.parameters(), "lr": a.critic_lr},
    ], eps=1e-6)

    # frozen models: no grads, no optimizer state
    ref = AutoModelForCausalLM.from_pretrained(a.sft, torch_dtype=torch.bfloat16, device_map="auto")
    ref.eval().requires_grad_(False)
    rm = AutoModelForSequenceClassification.from_pretrained(a.rm, num_labels=1, torch_dtype=torch.bfloat16).to(dev)
    rm.eval().requires_grad_(False)
    rm.config.pad_token_id = tok.pad_token_id

    ds = load_dataset(a.dataset, split="train_gen")
    ds = ds.filter(lambda ex: len(ex["prompt"]) < 2000)
    sampler = DistributedSampler(ds, shuffle=True, seed=a.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=a.rollouts_per_gpu, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: [[{"role": "user", "content": x["prompt"]}] for x in b])

    def batches():
        e = 0
        while True:
            sampler.set_epoch(e)
            yield from loader
            e += 1

    it_data = batches()
    t0 = time.time()
    for it in range(1, a.iters + 1):
        convs = next(it_data)
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False, truncation=True,
                  max_length=768).to(dev)
        P = enc.input_ids.shape[1]

        with torch.no_grad():
            ac.eval()
            seq = ac.actor.generate(**enc, max_new_tokens=a.max_new, do_sample=True, temperature=1.0, top_p=1.0,
                                    eos_token_id=eos_ids, pad_token_id=tok.pad_token_id)
            resp = seq[:, P:]
            attn = (seq != tok.pad_token_id).long()
            rmask = attn[:, P:].float()
            logits, values = ac(seq, attn)
            old_lp = token_lp(logits[:, P - 1:-1], resp)
            values = values[:, P - 1:-1] * rmask
            ref_logits = ref(input_ids=seq.to(ref.device), attention_mask=attn.to(ref.device)).logits.to(dev)
            ref_lp = token_lp(ref_logits[:, P - 1:-1], resp)
            score = rm(input_ids=seq, attention_mask=attn).logits[:, 0].float()

            kl = (old_lp - ref_lp) * rmask
            last = (rmask.sum(1) - 1).clamp(min=0).long()
            reward = -a.kl * kl
            reward[torch.arange(seq.size(0), device=dev), last] += score
            adv = torch.zeros_like(reward)
            acc = torch.zeros(seq.size(0), device=dev)
            for t in range(resp.size(1) - 1, -1, -1):
                nxt = values[:, t + 1] if t + 1 < resp.size(1) else torch.zeros_like(acc)
                acc = reward[:, t] + nxt - values[:, t] + 0.95 * acc
                adv[:, t] = acc
            ret = adv + values
            n_tok = rmask.sum()
            mu = (adv * rmask).sum() / n_tok
            sd = ((((adv - mu) ** 2) * rmask).sum() / n_tok).sqrt()
            adv = (adv - mu) / (sd + 1e-8) * rmask
            ac.train()

        for _ in range(a.ppo_epochs):
            for idx in torch.randperm(seq.size(0), device=dev).split(a.mb):
                lg, v = model(seq[idx], attn[idx])
                lp = token_lp(lg[:, P - 1:-1], resp[idx])
                v = v[:, P - 1:-1]
                mk = rmask[idx]
                ratio = (lp - old_lp[idx]).exp()
                pg = -torch.min(ratio * adv[idx], ratio.clamp(1 - a.clip, 1 + a.clip) * adv[idx])
                pg_loss = (pg * mk).sum() / mk.sum()
                v_loss = 0.5 * (((v - ret[idx]) ** 2) * mk).sum() / mk.sum()
                opt.zero_grad(set_to_none=True)
                (pg_loss + v_loss).backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

        s = torch.stack([score.mean(), kl.sum(1).mean(), rmask.sum(1).mean(), pg_loss.detach(), v_loss.detach()])
        dist.all_reduce(s, op=dist.ReduceOp.AVG)
        if rank == 0 and it % 5 == 0:
            print(f"it {it}/{a.iters} score {s[0]:.3f} kl {s[1]:.3f} len {s[2]:.0f} "
                  f"pg {s[3]:.4f} vf {s[4]:.4f} {time.time() - t0:.0f}s", flush=True)
        if rank == 0 and (it % 100 == 0 or it == a.iters):
            d = os.path.join(a.out, f"it{it}")
            ac.actor.save_pretrained(d)
            tok.save_pretrained(d)
            torch.save(ac.critic.state_dict(), os.path.join(d, "critic.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
