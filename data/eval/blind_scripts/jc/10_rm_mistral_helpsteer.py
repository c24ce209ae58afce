#!/usr/bin/env python
# Reward model fine-tune of Mistral-7B on HelpSteer2 pairs.
# Full fine-tune, bf16, activation checkpointing to fit 7B with seq len 2048 on 80GB cards.
#
#   torchrun --nproc_per_node=8 10_rm_mistral_helpsteer.py --output_dir /fsx/rm/mistral7b_hs2
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_cosine_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("--model_name_or_path", default="mistralai/Mistral-7B-v0.1")
p.add_argument("--dataset", default="nvidia/HelpSteer2")
p.add_argument("--output_dir", required=True)
p.add_argument("--max_seq_len", type=int, default=2048)
p.add_argument("--per_device_batch_size", type=int, default=1)
p.add_argument("--learning_rate", type=float, default=2e-6)
p.add_argument("--num_epochs", type=int, default=2)
p.add_argument("--warmup_steps", type=int, default=20)
p.add_argument("--margin_weight", type=float, default=0.0)
p.add_argument("--log_steps", type=int, default=10)
p.add_argument("--seed", type=int, default=42)


def to_pairs(ds):
    # HelpSteer2 rows come as two consecutive responses to the same prompt
    pairs = []
    for i in range(0, len(ds) - 1, 2):
        a, b = ds[i], ds[i + 1]
        if a["prompt"] != b["prompt"] or a["helpfulness"] == b["helpfulness"]:
            continue
        good, bad = (a, b) if a["helpfulness"] > b["helpfulness"] else (b, a)
        pairs.append({
            "prompt": a["prompt"],
            "chosen": good["response"],
            "rejected": bad["response"],
            "margin": float(good["helpfulness"] - bad["helpfulness"]),
        })
    return pairs


def make_collate(tok, max_len):
    def render(prompt, response):
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return tok.apply_chat_template(msgs, tokenize=False)

    def collate(rows):
        c = tok([render(r["prompt"], r["chosen"]) for r in rows], padding=True, truncation=True,
                max_length=max_len, return_tensors="pt", add_special_tokens=False)
        r = tok([render(r["prompt"], r["rejected"]) for r in rows], padding=True, truncation=True,
                max_length=max_len, return_tensors="pt", add_special_tokens=False)
        margin = torch.tensor([r_["margin"] for r_ in rows])
        return c["input_ids"], c["attention_mask"], r["input_ids"], r["attention_mask"], margin

    return collate


@torch.no_grad()
def eval_accuracy(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for c_ids, c_mask, r_ids, r_mask, _ in loader:
        rc = model(input_ids=c_ids.to(device), attention_mask=c_mask.to(device)).logits.squeeze(-1)
        rr = model(input_ids=r_ids.to(device), attention_mask=r_mask.to(device)).logits.squeeze(-1)
        t[0] += (rc > rr).sum()
        t[1] += rc.numel()
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token
    tok.padding_side = "right"
    if tok.chat_template is None:
        tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                             "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

    raw = load_dataset(args.dataset)
    train_pairs = to_pairs(raw["train"])
    val_pairs = to_pairs(raw["validation"])
    collate = make_collate(tok, args.max_seq_len)

    sampler = DistributedSampler(train_pairs, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_pairs, batch_size=args.per_device_batch_size, sampler=sampler,
                        collate_fn=collate, num_workers=2, drop_last=True)
    val_loader = DataLoader(val_pairs[rank::world], batch_size=4, collate_fn=collate)

    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, num_labels=1, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.pad_token_id = tok.pad_token_id
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.0, fused=True)
    total_steps = len(loader) * args.num_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(train_pairs)} train pairs, {len(val_pairs)} val pairs, {total_steps} steps on {world} GPUs")

    step = 0
    t0 = time.time()
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        for c_ids, c_mask, r_ids, r_mask, margin in loader:
            c_ids, c_mask = c_ids.to(device), c_mask.to(device)
            r_ids, r_mask = r_ids.to(device), r_mask.to(device)
            margin = margin.to(device)

            r_chosen = model(input_ids=c_ids, attention_mask=c_mask).logits.squeeze(-1).float()
            r_rejected = model(input_ids=r_ids, attention_mask=r_mask).logits.squeeze(-1).float()
            loss = -F.logsigmoid(r_chosen - r_rejected - args.margin_weight * margin).mean()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1

            if step % args.log_steps == 0:
                stats = torch.stack([loss.detach(), (r_chosen > r_rejected).float().mean(),
                                     (r_chosen - r_rejected).mean().detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    rate = step * args.per_device_batch_size * world / (time.time() - t0)
                    print(f"epoch {epoch} step {step}/{total_steps} loss {stats[0]:.4f} acc {stats[1]:.3f} "
                          f"margin {stats[2]:.3f} gnorm {gnorm:.2f} lr {scheduler.get_last_lr()[0]:.2e} "
                          f"{rate:.1f} pairs/s", flush=True)

        acc = eval_accuracy(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} validation accuracy {acc:.4f}", flush=True)
            out = os.path.join(args.output_dir, f"epoch_{epoch}")
            model.module.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
            with open(os.path.join(out, "val.json"), "w") as f:
                json.dump({"epoch": epoch, "val_accuracy": acc, "step": step}, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
