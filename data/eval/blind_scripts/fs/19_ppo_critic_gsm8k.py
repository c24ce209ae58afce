"""PPO with a separate critic network, outcome reward on GSM8K, resumable.

Actor: causal LM. Critic: same backbone with a scalar token-classification head.
Both are DDP-wrapped; one training_state.pt per checkpoint holds everything needed
to resume (weights, both optimizers, step, sampler epoch).

    torchrun --nproc_per_node 8 19_ppo_critic_gsm8k.py --ckpt_dir /shared/ppo_gsm8k [--resume /shared/ppo_gsm8k/step_600]
"""
import argparse
import os
import re

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mini", type=int, default=8)
    p.add_argument("--ppo_epochs", type=int, default=2)
    p.add_argument("--max_new", type=int, default=300)
    p.add_argument("--actor_lr", type=float, default=1e-6)
    p.add_argument("--critic_lr", type=float, default=5e-6)
    p.add_argument("--kl_coef", type=float, default=0.02)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--total_steps", type=int, default=1200)
    p.add_argument("--save_every", type=int, default=200)
    return p.parse_args()


def gsm_reward(text, answer):
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text.split("####")[-1] if "####" in text else text)
    if not nums:
        return 0.0
    try:
        return 1.0 if abs(float(nums[-1].replace(",", "")) - float(answer)) < 1e-4 else 0.0
    except ValueError:
        return 0.0


def logp_of(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def values_of(critic, ids, attn, P):
    return critic(input_ids=ids, attention_mask=attn).logits.squeeze(-1)[:, P - 1:-1].float()


def gae(rew, val, mask, gamma, lam):
    B, T = val.shape
    adv = torch.zeros_like(val)
    last = torch.zeros(B, device=val.device)
    for t in reversed(range(T)):
        nv = val[:, t + 1] * mask[:, t + 1] if t + 1 < T else torch.zeros(B, device=val.device)
        delta = rew[:, t] + gamma * nv - val[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        adv[:, t] = last
    ret = adv + val
    mu = (adv * mask).sum() / mask.sum()
    sd = (((adv - mu) ** 2) * mask).sum().div(mask.sum()).sqrt()
    return ((adv - mu) / (sd + 1e-8)).detach(), ret.detach()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(7 + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    actor = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    critic = AutoModelForTokenClassification.from_pretrained(args.model, num_labels=1,
                                                             torch_dtype=torch.bfloat16).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    a_opt = torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=0.0)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0)

    step, epoch = 0, 0
    if args.resume:
        state = torch.load(os.path.join(args.resume, "training_state.pt"))
        actor.load_state_dict(state["actor"])
        critic.load_state_dict(state["critic"])
        a_opt.load_state_dict(state["actor_opt"])
        c_opt.load_state_dict(state["critic_opt"])
        step, epoch = state["step"], state["epoch"]
        del state
        torch.cuda.empty_cache()

    actor_ddp = DDP(actor, device_ids=[local_rank])
    critic_ddp = DDP(critic, device_ids=[local_rank])

    ds = load_dataset("openai/gsm8k", "main", split="train")
    ds = ds.map(lambda r: {"gold": r["answer"].split("####")[-1].strip().replace(",", "")})
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True, collate_fn=lambda x: x)
    sampler.set_epoch(epoch)
    it = iter(dl)
    for _ in range(step % len(dl)):
        next(it)

    while step < args.total_steps:
        try:
            rows = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(dl)
            rows = next(it)

        chats = [tok.apply_chat_template([{"role": "user", "content": r["question"] +
                                           "\nEnd with '#### <number>'."}], tokenize=False,
                                         add_generation_prompt=True) for r in rows]
        enc = tok(chats, return_tensors="pt", padding=True).to(dev)
        P = enc.input_ids.size(1)
        actor.eval()
        with torch.no_grad():
            seq = actor.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=args.max_new,
                                 pad_token_id=tok.pad_token_id)
            resp = seq[:, P:]
            e = (resp == tok.eos_token_id).int()
            mask = ((e.cumsum(1) - e) == 0).float()
            attn = torch.cat([enc.attention_mask, mask.long()], 1)
            old_lp = logp_of(actor, seq, attn, P)
            ref_lp = logp_of(ref, seq, attn, P)
            old_v = values_of(critic, seq, attn, P)
        actor.train()

        texts = tok.batch_decode(resp, skip_special_tokens=True)
        score = torch.tensor([gsm_reward(t, r["gold"]) for t, r in zip(texts, rows)], device=dev)
        rew = -args.kl_coef * (old_lp - ref_lp) * mask
        last = mask.sum(1).long().clamp(min=1) - 1
        rew[torch.arange(rew.size(0)), last] += score
        adv, ret = gae(rew, old_v, mask, args.gamma, args.lam)

        for _ in range(args.ppo_epochs):
            for idx in torch.randperm(seq.size(0), device=dev).split(args.mini):
                m = mask[idx]
                lp = logp_of(actor_ddp, seq[idx], attn[idx], P)
                ratio = (lp - old_lp[idx]).exp()
                pg = -torch.min(ratio * adv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[idx])
                a_loss = (pg * m).sum() / m.sum()
                a_opt.zero_grad(set_to_none=True)
                a_loss.backward()
                torch.nn.utils.clip_grad_norm_(actor_ddp.parameters(), 1.0)
                a_opt.step()

                v = values_of(critic_ddp, seq[idx], attn[idx], P)
                v_clip = old_v[idx] + (v - old_v[idx]).clamp(-0.2, 0.2)
                c_loss = 0.5 * (torch.max((v - ret[idx]) ** 2, (v_clip - ret[idx]) ** 2) * m).sum() / m.sum()
                c_opt.zero_grad(set_to_none=True)
                c_loss.backward()
                torch.nn.utils.clip_grad_norm_(critic_ddp.parameters(), 1.0)
                c_opt.step()
        step += 1

        st = torch.stack([score.mean(), ((old_lp - ref_lp) * mask).sum(1).mean(), mask.sum(1).mean()])
        dist.all_reduce(st)
        st /= world
        if rank == 0 and step % 10 == 0:
            print(f"step {step} | acc {st[0]:.3f} | kl {st[1]:.3f} | len {st[2]:.0f}", flush=True)

        if step % args.save_every == 0:
            if rank == 0:
                out = os.path.join(args.ckpt_dir, f"step_{step}")
                os.makedirs(out, exist_ok=True)
                torch.save({"actor": actor.state_dict(), "critic": critic.state_dict(),
                            "actor_opt": a_opt.state_dict(), "critic_opt": c_opt.state_dict(),
                            "step": step, "epoch": epoch}, os.path.join(out, "training_state.pt"))
                actor.save_pretrained(os.path.join(out, "actor_hf"))
                tok.save_pretrained(os.path.join(out, "actor_hf"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
