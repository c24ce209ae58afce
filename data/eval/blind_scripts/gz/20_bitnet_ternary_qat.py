"""Ternary (1.58-bit, BitNet b1.58 style) QAT of a pretrained small LM.

All linear layers of the decoder blocks are replaced by BitLinear: weights are
quantized to {-1, 0, +1} * mean|W| (absmean), activations to int8 per token
(absmax), with straight-through gradients. Training continues from the
pretrained full-precision weights on a pre-tokenized corpus.

    torchrun --nproc_per_node=8 20_bitnet_ternary_qat.py --train_bin data/fineweb_smollm/train.bin
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-360M")
    ap.add_argument("--train_bin", default="data/fineweb_smollm/train.bin")
    ap.add_argument("--val_bin", default="data/fineweb_smollm/val.bin")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min_lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=375)
    ap.add_argument("--max_steps", type=int, default=20000)
    ap.add_argument("--eval_every", type=int, default=1000)
    ap.add_argument("--eval_batches", type=int, default=20)
    ap.add_argument("--out_dir", default="ckpt/smollm2-360m-b158")
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


class BinWindows(Dataset):
    def __init__(self, path, ctx):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.ctx = ctx

    def __len__(self):
        return len(self.tokens) // self.ctx

    def __getitem__(self, i):
        return torch.from_numpy(self.tokens[i * self.ctx:(i + 1) * self.ctx].astype(np.int64))


class BitLinear(nn.Linear):
    def forward(self, x):
        w = self.weight
        scale_w = w.abs().mean().clamp(min=1e-5)
        w_q = (w / scale_w).round().clamp(-1, 1) * scale_w
        w = w + (w_q - w).detach()
        scale_x = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
        x_q = (x * scale_x).round().clamp(-128, 127) / scale_x
        x = x + (x_q - x).detach()
        return F.linear(x, w, self.bias)


def to_bitnet(model):
    count = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if isinstance(lin, nn.Linear):
                    b = BitLinear(lin.in_features, lin.out_features, bias=lin.bias is not None)
                    b.weight = lin.weight
                    b.bias = lin.bias
                    setattr(parent, name, b)
                    count += 1
    return count


def lr_schedule(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))


@torch.no_grad()
def estimate_val(model, loader, n_batches, device):
    model.eval()
    s = torch.zeros(2, device=device)
    for i, x in enumerate(loader):
        if i >= n_batches:
            break
        x = x.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s[0] += model(input_ids=x, labels=x).loss
        s[1] += 1
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    train_ds = BinWindows(args.train_bin, args.ctx)
    val_ds = BinWindows(args.val_bin, args.ctx)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_ds, shuffle=True, seed=1), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    n_bit = to_bitnet(model)
    model.to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        if args.wandb:
            wandb.init(project="bitnet-qat", config=vars(args))
        print(f"{n_bit} BitLinear layers, {len(train_ds)} windows, world={world}", flush=True)

    step, epoch = 0, 0
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x in loader:
            lr = lr_schedule(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / 10
                    tps = args.batch_size * args.ctx * world / dt
                    print(f"step {step} loss {l.item():.4f} lr {lr:.2e} gnorm {gn:.2f} {tps:,.0f} tok/s", flush=True)
                    if args.wandb:
                        wandb.log({"loss": l.item(), "lr": lr, "grad_norm": gn.item(), "tok_s": tps}, step=step)
                t0 = time.time()

            if step % args.eval_every == 0 or step == args.max_steps:
                vl = estimate_val(model.module, val_loader, args.eval_batches, device)
                if rank == 0:
                    print(f"[val] step {step} loss {vl:.4f}", flush=True)
                    if args.wandb:
                        wandb.log({"val_loss": vl}, step=step)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(args.out_dir, "ckpt.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0 and args.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
