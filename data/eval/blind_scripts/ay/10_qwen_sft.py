#!/usr/bin/env python
"""Full-parameter SFT of Qwen2.5-1.5B with DDP, length-bucketed padding, bf16 autocast.

    torchrun --nproc_per_node=8 10_qwen_sft.py --data /shared/sft/mix_v3.jsonl \
        --out /shared/runs/qwen15b_sft --resume auto
"""
import argparse
import glob
import json
import math
import os
import re
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE_INDEX = -100


class ChatSFT(Dataset):
    def __init__(self, path, tok, max_len):
        self.samples = []
        with open(path) as f:
            for line in f:
                msgs = json.loads(line)["messages"]
                prompt = tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True)
                full = tok.apply_chat_template(msgs, tokenize=True)
                if len(full) > max_len:
                    continue
                labels = [IGNORE_INDEX] * len(prompt) + full[len(prompt):]
                self.samples.append((full, labels))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def make_collate(pad_id, multiple=64):
    def collate(batch):
        L = max(len(x) for x, _ in batch)
        L = (L + multiple - 1) // multiple * multiple
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), IGNORE_INDEX, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for j, (x, y) in enumerate(batch):
            ids[j, : len(x)] = torch.tensor(x)
            lab[j, : len(y)] = torch.tensor(y)
            att[j, : len(x)] = 1
        return ids, lab, att
    return collate


def latest_checkpoint(out_dir):
    cands = glob.glob(os.path.join(out_dir, "step_*.pt"))
    if not cands:
        return None
    return max(cands, key=lambda p: int(re.search(r"step_(\d+)", p).group(1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--resume", default="", help="path, or 'auto' for the newest in --out")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    ds = ChatSFT(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=make_collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True, persistent_workers=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True, bucket_cap_mb=256)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)

    updates_per_epoch = math.ceil(len(loader) / args.accum)
    total = updates_per_epoch * args.epochs
    warmup = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, warmup) if s < warmup else
        0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))

    step, start_epoch, skip_batches = 0, 0, 0
    ckpt_path = latest_checkpoint(args.out) if args.resume == "auto" else args.resume
    if ckpt_path:
        state = torch.load(ckpt_path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, start_epoch = state["step"], state["epoch"]
        skip_batches = (step - start_epoch * updates_per_epoch) * args.accum
        del state
        torch.cuda.empty_cache()
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}", flush=True)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    tok_count = torch.zeros((), device=device)
    loss_acc = torch.zeros((), device=device)
    t0 = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for i, (ids, lab, att) in enumerate(loader):
            if epoch == start_epoch and i < skip_batches:
                continue
            ids = ids.to(device, non_blocking=True)
            lab = lab.to(device, non_blocking=True)
            att = att.to(device, non_blocking=True)
            boundary = (i + 1) % args.accum == 0 or i + 1 == len(loader)
            if boundary:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = ddp(input_ids=ids, attention_mask=att, labels=lab).loss
                (loss / args.accum).backward()
            else:
                with ddp.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = ddp(input_ids=ids, attention_mask=att, labels=lab).loss
                    (loss / args.accum).backward()
            loss_acc += loss.detach() / args.accum
            tok_count += att.sum()
            if not boundary:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                stats = torch.stack([loss_acc, tok_count])
                dist.all_reduce(stats)
                dt = time.perf_counter() - t0
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {stats[0].item() / world / 10:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {stats[1].item() / dt:,.0f} tok/s", flush=True)
                loss_acc.zero_()
                tok_count.zero_()
                t0 = time.perf_counter()

            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "step": step, "epoch": epoch},
                               os.path.join(args.out, f"step_{step}.pt"))
                dist.barrier()

    if rank == 0:
        model.save_pretrained(os.path.join(args.out, "final"), safe_serialization=True)
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
