"""REINFORCE++ on Anthropic HH prompts with a Llama reward model.

REINFORCE++ = REINFORCE with per-token KL folded into the return and advantages
normalised over the *global* batch (mean/std all-reduced across ranks).

    torchrun --nproc_per_node 8 10_reinforcepp_hh_rlhf.py --policy meta-llama/Llama-3.2-1B-Instruct
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

log = logging.getLogger(__name__)


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="meta-llama/Llama-3.2-1B-Instruct")
    p.add_argument("--reward_model", default="Ray2333/GRM-Llama3.2-3B-rewardmodel-ft")
    p.add_argument("--save_dir", default="ckpts/reinforcepp_hh")
    p.add_argument("--rollout_bs", type=int, default=16)
    p.add_argument("--train_bs", type=int, default=8)
    p.add_argument("--gen_tokens", type=int, default=256)
    p.add_argument("--init_kl_coef", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--num_episodes", type=int, default=1)
    p.add_argument("--reward_clip", type=float, default=10.0)
    p.add_argument("--save_steps", type=int, default=250)
    return p.parse_args()


def first_turn(example):
    # "\n\nHuman: ... \n\nAssistant: ..." -> first human turn only
    text = example["chosen"]
    human = text.split("\n\nAssistant:")[0].replace("\n\nHuman:", "").strip()
    return {"prompt": human}


def masked_mean(x, m, dim=None):
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def global_whiten(x, m):
    s = torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()])
    dist.all_reduce(s)
    mean = s[0] / s[2]
    var = s[1] / s[2] - mean ** 2
    return (x - mean) * torch.rsqrt(var + 1e-8) * m


def logprobs_of(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(42 + rank)

    tok = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = "<|finetune_right_pad_id|>"

    actor = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(device)
    initial = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16, device_map="auto")
    initial.eval().requires_grad_(False)
    rm_tok = AutoTokenizer.from_pretrained(args.reward_model)
    rm = AutoModelForSequenceClassification.from_pretrained(args.reward_model, torch_dtype=torch.bfloat16)
    rm.to(device).eval().requires_grad_(False)

    actor_ddp = DDP(actor, device_ids=[local_rank])
    optim = torch.optim.Adam(actor_ddp.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    ds = load_dataset("Anthropic/hh-rlhf", split="train").map(first_turn, remove_columns=["chosen", "rejected"])
    ds = ds.filter(lambda e: 8 < len(e["prompt"]) < 1200)
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    dl = DataLoader(ds, batch_size=args.rollout_bs, sampler=sampler, drop_last=True,
                    collate_fn=lambda rows: [r["prompt"] for r in rows])

    global_step = 0
    for episode in range(args.num_episodes):
        sampler.set_epoch(episode)
        for prompts in dl:
            chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in prompts]
            enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            P = enc.input_ids.size(1)

            actor.eval()
            with torch.no_grad():
                seq = actor.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0,
                                     max_new_tokens=args.gen_tokens, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                eos = torch.isin(resp, torch.tensor([tok.eos_token_id, tok.convert_tokens_to_ids("<|eot_id|>")],
                                                    device=device)).int()
                mask = ((eos.cumsum(1) - eos) == 0).float()
                attn = torch.cat([enc.attention_mask, mask.long()], 1)

                old_lp = logprobs_of(actor, seq, attn, P)
                init_lp = logprobs_of(initial, seq.to(initial.device), attn.to(initial.device), P).to(device)

                answers = tok.batch_decode(resp, skip_special_tokens=True)
                rm_text = [rm_tok.apply_chat_template([{"role": "user", "content": p},
                                                       {"role": "assistant", "content": a}], tokenize=False)
                           for p, a in zip(prompts, answers)]
                rm_in = rm_tok(rm_text, return_tensors="pt", padding=True, truncation=True,
                               max_length=2048).to(device)
                score = rm(**rm_in).logits[:, 0].float().clamp(-args.reward_clip, args.reward_clip)

                # per-token reward: -kl everywhere, + score on the last response token
                kl = (old_lp - init_lp) * mask
                tok_rew = -args.init_kl_coef * kl
                last = mask.sum(1).long().clamp(min=1) - 1
                tok_rew[torch.arange(len(last)), last] += score
                returns = torch.flip(torch.cumsum(torch.flip(tok_rew, [1]), 1), [1])
                adv = global_whiten(returns, mask)
            actor.train()

            n = seq.size(0)
            for idx in torch.randperm(n, device=device).split(args.train_bs):
                lp = logprobs_of(actor_ddp, seq[idx], attn[idx], P)
                ratio = torch.exp(lp - old_lp[idx])
                surr = torch.min(ratio * adv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[idx])
                loss = -masked_mean(surr, mask[idx])
                optim.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(actor_ddp.parameters(), 1.0)
                optim.step()
            global_step += 1

            m = torch.stack([score.mean(), masked_mean(kl, mask, 1).mean(), mask.sum(1).mean()])
            dist.all_reduce(m)
            m /= world
            log.info("step %d | rm %.3f | kl %.4f | len %.1f", global_step, *m.tolist())

            if global_step % args.save_steps == 0:
                if rank == 0:
                    path = os.path.join(args.save_dir, f"global_step{global_step}")
                    actor.save_pretrained(path)
                    tok.save_pretrained(path)
                dist.barrier()

    if rank == 0:
        actor.save_pretrained(os.path.join(args.save_dir, "final"))
        tok.save_pretrained(os.path.join(args.save_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
