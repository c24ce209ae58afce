"""Text classification with a 24-layer Transformer encoder, LAMB, bf16 gradient
compression and activation checkpointing.

- DDP all-reduces bf16 copies of the gradient buckets (bf16_compress_hook)
- every encoder block is recomputed in backward (non-reentrant checkpoint)
- gradient accumulation with no_sync() on the micro-steps

launch:
    torchrun --nnodes=1 --nproc_per_node=8 12_lamb_bf16hook_encoder.py --data /data/amazon_polarity_tok
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = st["m"] / (1 - b1 ** st["step"])
                v_hat = st["v"] / (1 - b2 ** st["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm = p.norm()
                u_norm = update.norm()
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * ratio, alpha=-group["lr"])


class EncoderClassifier(nn.Module):
    def __init__(self, vocab, dim=1024, layers=24, heads=16, max_len=512, n_classes=2, grad_ckpt=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers)
        ])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)
        self.grad_ckpt = grad_ckpt

    def forward(self, ids):
        pad = ids == 0
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, None, pad, use_reentrant=False)
            else:
                x = blk(x, src_key_padding_mask=pad)
        x = self.norm(x)
        keep = (~pad).unsqueeze(-1).float()
        pooled = (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.head(pooled)


def collate(batch, max_len):
    ids = [torch.tensor(b["input_ids"][:max_len]) for b in batch]
    ids = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0)
    labels = torch.tensor([b["label"] for b in batch])
    return ids, labels


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for ids, y in loader:
        ids, y = ids.to(device), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids)
        s[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        s[1] += (logits.argmax(-1) == y).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--micro_bs", type=int, default=32)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--base_lr", type=float, default=2e-3, help="lr for global batch 1024")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--warmup_ratio", type=float, default=0.06)
    ap.add_argument("--out", default="/shared/runs/lamb_enc")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = load_from_disk(args.data)
    train_ds, val_ds = ds["train"], ds["test"]
    tr_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    coll = lambda b: collate(b, args.max_len)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=tr_sampler, collate_fn=coll,
                          num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=128, sampler=va_sampler, collate_fn=coll, num_workers=4)

    model = EncoderClassifier(vocab=30522, max_len=args.max_len).to(device)
    ddp = DDP(model, device_ids=[local_rank], static_graph=False)
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)

    global_bs = args.micro_bs * args.accum * world
    lr = args.base_lr * math.sqrt(global_bs / 1024)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos" not in n)]
    opt = Lamb([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    steps_per_epoch = len(train_dl) // args.accum
    total = steps_per_epoch * args.epochs
    warm = int(args.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / (total - warm))))

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch {global_bs}, lr {lr:.2e}, {total} optimizer steps")

    for epoch in range(start_epoch, args.epochs):
        tr_sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        for i, (ids, y) in enumerate(train_dl):
            if i >= steps_per_epoch * args.accum:
                break
            ids, y = ids.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (i + 1) % args.accum == 0
            with (contextlib.nullcontext() if sync_now else ddp.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(ddp(ids).float(), y) / args.accum
                loss.backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step = sched.last_epoch
                if rank == 0 and step % 20 == 0:
                    print(f"ep {epoch} step {step}/{total} loss {loss.item() * args.accum:.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e}")

        val_loss, val_acc = evaluate(ddp, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f} val_acc {val_acc:.4f} ({time.time() - t0:.0f}s)")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
