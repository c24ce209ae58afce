"""MaskGIT-style masked token modeling on pre-extracted tokens (CelebA-HQ 256, 16x16 grid).

Launch:

    torchrun --nproc_per_node=8 14_maskgit_celebahq.py --train_tokens tok/celebahq_train.pt \
        --val_tokens tok/celebahq_val.pt --out runs/maskgit_celebahq --batch_size 64 --lr 2e-4
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train_tokens", required=True)
    p.add_argument("--val_tokens", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--codebook", type=int, default=1024)
    p.add_argument("--grid", type=int, default=16)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=400)
    p.add_argument("--warmup_steps", type=int, default=5000)
    p.add_argument("--eval_every", type=int, default=10)
    return p.parse_args()


class TransformerLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.h = h

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class MaskedTokenModel(nn.Module):
    def __init__(self, codebook, n_tokens, width, layers, heads):
        super().__init__()
        self.mask_id = codebook
        self.emb = nn.Embedding(codebook + 1, width)
        self.pos = nn.Parameter(torch.randn(1, n_tokens, width) * 0.02)
        self.layers = nn.ModuleList([TransformerLayer(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width, eps=1e-6)
        # logits tied to the token embedding (as in the MaskGIT reference code) plus a bias
        self.bias = nn.Parameter(torch.zeros(codebook + 1))

    def forward(self, idx):
        x = self.emb(idx) + self.pos
        for layer in self.layers:
            x = layer(x)
        return (self.norm(x) @ self.emb.weight.t() + self.bias)[..., : self.mask_id]


def random_masking(tokens, mask_id):
    b, n = tokens.shape
    r = torch.rand(b, device=tokens.device)
    n_mask = torch.clamp((torch.cos(r * math.pi / 2) * n).floor(), min=1).long()
    noise = torch.rand(b, n, device=tokens.device)
    order = noise.argsort(dim=1)
    mask = torch.zeros(b, n, dtype=torch.bool, device=tokens.device)
    mask.scatter_(1, order, torch.arange(n, device=tokens.device).expand(b, n) < n_mask[:, None])
    return tokens.masked_fill(mask, mask_id), mask


@torch.no_grad()
def validate(model, loader, device, mask_id):
    model.eval()
    g = torch.Generator(device=device).manual_seed(0)
    tot = torch.zeros(3, device=device)
    for (tok,) in loader:
        tok = tok.to(device)
        noise = torch.rand(tok.shape, device=device, generator=g)
        mask = noise < 0.5
        logits = model(tok.masked_fill(mask, mask_id))
        tot[0] += F.cross_entropy(logits[mask], tok[mask], reduction="sum")
        tot[1] += (logits[mask].argmax(-1) == tok[mask]).sum()
        tot[2] += mask.sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = TensorDataset(torch.load(args.train_tokens, map_location="cpu").long().flatten(1))
    val_ds = TensorDataset(torch.load(args.val_tokens, map_location="cpu").long().flatten(1))
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                          num_workers=2, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=256, sampler=val_sampler, num_workers=2)

    model = MaskedTokenModel(args.codebook, args.grid ** 2, args.width, args.layers, args.heads).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "pos" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.96))
    num_training_steps = args.epochs * (len(train_ds) // args.batch_size)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup_steps, num_training_steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        running = torch.zeros(2, device=device)
        for (tok,) in train_dl:
            tok = tok.to(device, non_blocking=True)
            inp, mask = random_masking(tok, args.codebook)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = F.cross_entropy(logits.float()[mask], tok[mask], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            running += torch.stack([loss.detach(), torch.ones((), device=device)])

        dist.all_reduce(running)
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {running[0] / running[1]:.4f} lr {sched.get_last_lr()[0]:.3e}",
                  flush=True)
        if (epoch + 1) % args.eval_every == 0:
            vloss, vacc = validate(model, val_dl, device, args.codebook)
            if rank == 0:
                print(f"  val loss {vloss:.4f} acc {vacc:.4f}", flush=True)
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "epoch": epoch, "step": step}
                torch.save(state, os.path.join(args.out, "last.pt"))
                if vloss < best:
                    best = vloss
                    torch.save(state, os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
