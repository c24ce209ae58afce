"""Actor-critic RL on Knights-and-Knaves logic puzzles.

One script for both estimators we compare in the paper:
  --algo ppo   : token-level GAE with the learned value head
  --algo grpo  : group-normalised outcome advantages (value head not needed)

    torchrun --nproc_per_node 8 07_actor_critic_kk_logic.py --algo grpo --model Qwen/Qwen2.5-7B-Instruct-1M
"""
import argparse
import contextlib
import os
import re
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

INSTRUCT = ("{quiz}\nThink it through, then give the final answer inside <answer></answer> as one line "
            "per person, e.g. '(1) Zoey is a knight'.")


class ActorCritic(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
        hidden = self.lm.config.hidden_size
        self.value_head = nn.Sequential(nn.Linear(hidden, 1024), nn.GELU(), nn.Linear(1024, 1)).to(torch.bfloat16)

    def forward(self, input_ids, attention_mask):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        values = self.value_head(out.hidden_states[-1]).squeeze(-1).float()
        return out.logits, values


def parse_solution(text):
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    if not m:
        return None
    roles = {}
    for name, role in re.findall(r"([A-Z][a-z]+) is a (knight|knave)", m.group(1)):
        roles[name] = role
    return roles


def kk_reward(text, solution_text):
    pred = parse_solution(text)
    if pred is None:
        return -1.0
    gold = dict(re.findall(r"([A-Z][a-z]+) is a (knight|knave)", solution_text))
    return 1.0 if pred == gold else -0.5


def gather_logp(logits, ids):
    return torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def gae(rewards_last, values, mask, gamma=1.0, lam=0.95):
    # outcome reward placed on the last valid token
    B, T = values.shape
    last_idx = mask.sum(1).long() - 1
    rew = torch.zeros_like(values)
    rew[torch.arange(B), last_idx] = rewards_last
    adv = torch.zeros_like(values)
    running = torch.zeros(B, device=values.device)
    for t in reversed(range(T)):
        nv = values[:, t + 1] * mask[:, t + 1] if t + 1 < T else torch.zeros(B, device=values.device)
        delta = rew[:, t] + gamma * nv - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv, adv + values


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-7B-Instruct-1M")
    ap.add_argument("--algo", choices=["ppo", "grpo"], default="grpo")
    ap.add_argument("--n_prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--mb", type=int, default=4)
    ap.add_argument("--max_new", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--vf_lr_mult", type=float, default=5.0)
    ap.add_argument("--vf_coef", type=float, default=0.5)
    ap.add_argument("--beta", type=float, default=0.001)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default="runs/kk")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(100 + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    ac = ActorCritic(args.model).to(dev)
    ac.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)

    model = DDP(ac, device_ids=[local_rank])
    opt = torch.optim.AdamW([
        {"params": ac.lm.parameters(), "lr": args.lr},
        {"params": ac.value_head.parameters(), "lr": args.lr * args.vf_lr_mult},
    ], weight_decay=0.0)

    ds = load_dataset("K-and-K/knights-and-knaves", "train", split="3ppl")
    sampler = DistributedSampler(ds, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=args.n_prompts, sampler=sampler, drop_last=True, collate_fn=lambda x: x)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for rows in dl:
            chats = [tok.apply_chat_template([{"role": "user", "content": INSTRUCT.format(quiz=r["quiz"])}],
                                             tokenize=False, add_generation_prompt=True) for r in rows]
            enc = tok(chats, return_tensors="pt", padding=True).to(dev)
            ids = enc.input_ids.repeat_interleave(args.group, 0)
            am = enc.attention_mask.repeat_interleave(args.group, 0)
            P = ids.size(1)

            model.eval()
            with torch.no_grad():
                seq = ac.lm.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=0.7,
                                     max_new_tokens=args.max_new, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).float()
                attn = torch.cat([am, mask.long()], 1)
                old_lp, old_v, ref_lp = [], [], []
                for i in range(0, seq.size(0), args.mb):
                    lg, v = ac(seq[i:i + args.mb], attn[i:i + args.mb])
                    old_lp.append(gather_logp(lg[:, P - 1:-1], resp[i:i + args.mb]))
                    old_v.append(v[:, P - 1:-1])
                    ref_lp.append(gather_logp(ref(input_ids=seq[i:i + args.mb], attention_mask=attn[i:i + args.mb]).logits[:, P - 1:-1], resp[i:i + args.mb]))
                old_lp, old_v, ref_lp = torch.cat(old_lp), torch.cat(old_v), torch.cat(ref_lp)
            model.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            sols = [r["solution_text"] for r in rows for _ in range(args.group)]
            rewards = torch.tensor([kk_reward(t, s) for t, s in zip(texts, sols)], device=dev)

            if args.algo == "ppo":
                adv, returns = gae(rewards, old_v, mask)
                mu = (adv * mask).sum() / mask.sum()
                sd = (((adv - mu) ** 2 * mask).sum() / mask.sum()).sqrt()
                adv = (adv - mu) / (sd + 1e-6)
            else:
                g = rewards.view(-1, args.group)
                a = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
                adv = a.view(-1, 1).expand_as(mask)
                returns = None

            logs = defaultdict(float)
            idxs = list(range(0, seq.size(0), args.mb))
            ntok = mask.sum()
            for j, i in enumerate(idxs):
                sl = slice(i, i + args.mb)
                with (model.no_sync() if j < len(idxs) - 1 else contextlib.nullcontext()):
                    logits, values = model(seq[sl], attn[sl])
                    lp = gather_logp(logits[:, P - 1:-1], resp[sl])
                    ratio = (lp - old_lp[sl]).exp()
                    pg = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[sl])
                    d = ref_lp[sl] - lp
                    kl = d.exp() - d - 1
                    loss = ((pg + args.beta * kl) * mask[sl]).sum() / ntok
                    if args.algo == "ppo":
                        v = values[:, P - 1:-1]
                        vf = ((v - returns[sl]) ** 2 * mask[sl]).sum() / ntok
                        loss = loss + args.vf_coef * vf
                        logs["vf"] += vf.item()
                    loss.backward()
                logs["loss"] += loss.item()
                logs["kl"] += ((kl * mask[sl]).sum() / ntok).item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            red = torch.tensor([rewards.mean().item(), (rewards == 1.0).float().mean().item(),
                                logs["loss"], logs["kl"]], device=dev)
            dist.all_reduce(red)
            red /= world
            if rank == 0 and step % 5 == 0:
                print(f"[{args.algo}] ep {epoch} step {step} reward {red[0]:.3f} acc {red[1]:.3f} "
                      f"loss {red[2]:.4f} kl {red[3]:.5f}", flush=True)
            if step % 100 == 0:
                if rank == 0:
                    d = os.path.join(args.out, args.algo, f"step{step}")
                    ac.lm.save_pretrained(d)
                    tok.save_pretrained(d)
                    torch.save(ac.value_head.state_dict(), os.path.join(d, "value_head.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
