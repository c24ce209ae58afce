"""Offline top-k logit distillation.

The teacher's top-k (k=32) token ids and log-probs for every position were
dumped once (see dump_teacher_topk.py) into parquet files next to the token
ids, so the teacher does not have to be resident during student training.
The KD loss is the cross-entropy between the renormalised teacher top-k
distribution and the student's log-probs gathered on the same ids.

    torchrun --nproc_per_node=8 17_sparse_topk_kd.py --data "kd_dump/*.parquet" --student TinyLlama/TinyLlama_v1.1
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModelForCausalLM, get_wsd_schedule, set_seed


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="kd_dump/*.parquet")
    ap.add_argument("--student", default="TinyLlama/TinyLlama_v1.1")
    ap.add_argument("--output_dir", default="runs/topk-kd-tinyllama")
    ap.add_argument("--val_fraction", type=float, default=0.02)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=4e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kd_weight", type=float, default=0.8)
    ap.add_argument("--kd_temp", type=float, default=1.0)
    ap.add_argument("--eval_steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    topk_ids = torch.tensor([r["topk_ids"] for r in rows], dtype=torch.long)      # [B, T, K]
    topk_lp = torch.tensor([r["topk_logprobs"] for r in rows], dtype=torch.float32)  # [B, T, K]
    return ids, topk_ids, topk_lp


def topk_kd_loss(logits, ids, topk_ids, topk_lp, kd_weight, T):
    # position t of the dump holds the teacher distribution for token t+1
    logits = logits[:, :-1].float()
    topk_ids, topk_lp = topk_ids[:, :-1], topk_lp[:, :-1]
    s_lp = F.log_softmax(logits / T, dim=-1)
    s_lp_k = torch.gather(s_lp, -1, topk_ids)
    t_p = F.softmax(topk_lp / T, dim=-1)  # renormalise over the kept top-k
    kd = -(t_p * s_lp_k).sum(-1).mean() * T * T
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    return kd_weight * kd + (1 - kd_weight) * ce, kd.detach(), ce.detach()


@torch.no_grad()
def evaluate(model, loader, device, args):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for ids, tk, tl in loader:
        ids, tk, tl = ids.to(device), tk.to(device), tl.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        _, kd, ce = topk_kd_loss(logits, ids, tk, tl, args.kd_weight, args.kd_temp)
        acc += torch.stack([kd.double() * ids.size(0), ce.double() * ids.size(0),
                            torch.tensor(float(ids.size(0)), device=device, dtype=torch.float64)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different dropout masks / noise on each rank
    set_seed(args.seed + rank)

    if rank != 0:
        dist.barrier()  # let rank 0 build the arrow cache first
    raw = load_dataset("parquet", data_files=args.data, split="train")
    if rank == 0:
        dist.barrier()
    splits = raw.train_test_split(test_size=args.val_fraction)
    train_ds, val_ds = splits["train"], splits["test"]

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=6, pin_memory=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            collate_fn=collate, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    total = len(train_loader) * args.epochs
    sched = get_wsd_schedule(opt, num_warmup_steps=int(0.02 * total), num_decay_steps=int(0.2 * total),
                             num_stable_steps=total - int(0.02 * total) - int(0.2 * total))

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        writer = SummaryWriter(args.output_dir)
        print(f"train {len(train_ds)} / val {len(val_ds)} sequences, {total} steps", flush=True)

    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for ids, tk, tl in train_loader:
            ids, tk, tl = ids.to(device, non_blocking=True), tk.to(device, non_blocking=True), tl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            loss, kd, ce = topk_kd_loss(logits, ids, tk, tl, args.kd_weight, args.kd_temp)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                vals = torch.stack([loss.detach(), kd, ce])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", vals[0].item(), step)
                    writer.add_scalar("train/kd", vals[1].item(), step)
                    writer.add_scalar("train/ce", vals[2].item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    print(f"ep {epoch} step {step} loss {vals[0].item():.4f} "
                          f"({(time.time() - t0) / 50:.2f}s/step)", flush=True)
                t0 = time.time()

            if step % args.eval_steps == 0:
                v_kd, v_ce = evaluate(model.module, val_loader, device, args)
                if rank == 0:
                    writer.add_scalar("val/kd", v_kd, step)
                    writer.add_scalar("val/ppl", math.exp(v_ce), step)
                    if v_kd < best:
                        best = v_kd
                        model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
