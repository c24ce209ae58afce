"""GRPO on ARC-Challenge multiple choice with a sparse MoE policy (OLMoE-1B-7B).

Only the top-k experts see tokens in a given step, so DDP has to be told that some
parameters may not receive gradients. Router load-balancing loss is kept on.

    torchrun --nproc_per_node=8 18_grpo_olmoe_arc.py --output_dir /mnt/shared/olmoe_arc
"""
import argparse
import contextlib
import json
import os
import re

import torch
import torch.distributed as dist
from datasets import concatenate_datasets, load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

LETTER = re.compile(r"answer is\s*\(?([A-E])\)?", re.I)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="allenai/OLMoE-1B-7B-0924-Instruct")
    p.add_argument("--output_dir", default="runs/olmoe_arc")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=384)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--aux_coef", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--save_every", type=int, default=100)
    return p.parse_args()


def format_q(ex):
    choices = "\n".join(f"({l}) {t}" for l, t in zip(ex["choices"]["label"], ex["choices"]["text"]))
    return (f"Question: {ex['question']}\n{choices}\n"
            "Think step by step, then finish with 'The answer is (X)'.")


def mc_reward(text, key):
    m = LETTER.findall(text)
    if not m:
        return 0.0
    return 1.0 if m[-1].upper() == key else 0.0


def forward_logps(model, ids, attn, P, with_aux=False):
    out = model(input_ids=ids, attention_mask=attn, output_router_logits=with_aux)
    logits = out.logits[:, P - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
    return (lp, out.aux_loss) if with_aux else lp


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(31 + rank)

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev)
    policy.config.router_aux_loss_coef = args.aux_coef
    policy.gradient_checkpointing_enable()
    ref = None
    if args.beta > 0:
        ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
        ref.requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank], find_unused_parameters=True)

    arc = load_dataset("allenai/ai2_arc", "ARC-Challenge")
    train = concatenate_datasets([arc["train"], arc["validation"]])
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    dl = DataLoader(train, batch_size=args.prompts, sampler=sampler, drop_last=True, collate_fn=lambda x: x)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = len(dl) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, max(1, total // 20), total)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for rows in dl:
            chats = [tok.apply_chat_template([{"role": "user", "content": format_q(r)}], tokenize=False,
                                             add_generation_prompt=True) for r in rows]
            enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
            ids = enc.input_ids.repeat_interleave(args.G, 0)
            am = enc.attention_mask.repeat_interleave(args.G, 0)
            P = ids.size(1)

            model.eval()
            with torch.no_grad():
                seq = policy.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                      max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id,
                                      use_cache=True)
                resp = seq[:, P:]
                e = (resp == tok.eos_token_id).int()
                mask = ((e.cumsum(1) - e) == 0).long()
                attn = torch.cat([am, mask], 1)
                old = torch.cat([forward_logps(policy, seq[i:i + args.micro], attn[i:i + args.micro], P)
                                 for i in range(0, seq.size(0), args.micro)])
                rlp = None
                if ref is not None:
                    rlp = torch.cat([forward_logps(ref, seq[i:i + args.micro], attn[i:i + args.micro], P)
                                     for i in range(0, seq.size(0), args.micro)])
            model.train()

            texts = tok.batch_decode(resp, skip_special_tokens=True)
            keys = [r["answerKey"] for r in rows for _ in range(args.G)]
            rew = torch.tensor([mc_reward(t, k) for t, k in zip(texts, keys)], device=dev)
            grp = rew.view(-1, args.G)
            adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-4)).view(-1, 1)

            n_mb = seq.size(0) // args.micro
            ntok = mask.sum().clamp(min=1)
            aux_total = 0.0
            for j in range(n_mb):
                sl = slice(j * args.micro, (j + 1) * args.micro)
                with (model.no_sync() if j < n_mb - 1 else contextlib.nullcontext()):
                    lp, aux = forward_logps(model, seq[sl], attn[sl], P, with_aux=True)
                    ratio = (lp - old[sl]).exp()
                    per_tok = -torch.min(ratio * adv[sl], ratio.clamp(1 - args.clip, 1 + args.clip) * adv[sl])
                    if rlp is not None:
                        d = rlp[sl] - lp
                        per_tok = per_tok + args.beta * (d.exp() - d - 1)
                    loss = (per_tok * mask[sl]).sum() / ntok + args.aux_coef * aux / n_mb
                    loss.backward()
                aux_total += aux.item() / n_mb
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            s = torch.tensor([rew.mean().item(), aux_total, mask.sum(1).float().mean().item()], device=dev)
            dist.all_reduce(s)
            s /= world
            if rank == 0:
                print(json.dumps({"step": step, "acc": round(s[0].item(), 4), "aux": round(s[1].item(), 4),
                                  "len": round(s[2].item(), 1), "gnorm": round(gn.item(), 3)}), flush=True)

            if step % args.save_every == 0:
                if rank == 0:
                    out = os.path.join(args.output_dir, f"step{step}")
                    policy.save_pretrained(out)
                    tok.save_pretrained(out)
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
