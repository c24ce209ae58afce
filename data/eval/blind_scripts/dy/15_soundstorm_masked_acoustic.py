"""SoundStorm-style parallel acoustic token generator.

Input: HuBERT k-means semantic tokens (50 Hz, 500 units) aligned with 8 EnCodec
codebooks (50 Hz, 1024 codes). Training follows the MaskGIT recipe per RVQ level:
levels below the sampled one are given, the sampled level is partially masked with a
cosine schedule, levels above are fully masked.

    torchrun --nproc_per_node=8 15_soundstorm_masked_acoustic.py --data /data/soundstorm/librilight
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_SEM, N_Q, CARD = 500, 8, 1024
MASK = CARD  # acoustic embedding index used for masked positions


class AlignedTokens(Dataset):
    """<split>.txt lists utterance ids; <id>.sem.npy is [T] and <id>.ac.npy is [8, T]."""

    def __init__(self, root, split, frames):
        with open(os.path.join(root, f"{split}.txt")) as f:
            self.ids = [l.strip() for l in f if l.strip()]
        self.root, self.frames, self.train = root, frames, split == "train"

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        uid = self.ids[i]
        sem = np.load(os.path.join(self.root, f"{uid}.sem.npy"))
        ac = np.load(os.path.join(self.root, f"{uid}.ac.npy"))
        t = min(len(sem), ac.shape[1])
        s = random.randint(0, max(0, t - self.frames)) if self.train else 0
        e = min(t, s + self.frames)
        sem_t = torch.full((self.frames,), N_SEM, dtype=torch.long)
        ac_t = torch.full((N_Q, self.frames), -100, dtype=torch.long)
        sem_t[: e - s] = torch.from_numpy(sem[s:e].astype(np.int64))
        ac_t[:, : e - s] = torch.from_numpy(ac[:, s:e].astype(np.int64))
        return sem_t, ac_t


class SoundStormLite(nn.Module):
    def __init__(self, dim=1024, layers=12, heads=16, frames=1000):
        super().__init__()
        self.sem_emb = nn.Embedding(N_SEM + 1, dim)
        self.ac_emb = nn.ModuleList(nn.Embedding(CARD + 1, dim) for _ in range(N_Q))
        self.pos = nn.Parameter(torch.randn(frames, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, "gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, N_Q * CARD)  # one projection, sliced per level

    def forward(self, sem, ac_in, level, pad_mask):
        x = self.sem_emb(sem) + sum(self.ac_emb[q](ac_in[:, q]) for q in range(N_Q))
        x = x + self.pos[: x.shape[1]]
        h = self.norm(self.encoder(x, src_key_padding_mask=pad_mask))
        return self.head(h).view(h.shape[0], h.shape[1], N_Q, CARD)[:, :, level]


def make_inputs(ac, level, generator=None):
    """Returns masked acoustic input and the target for `level` (only masked positions count)."""
    valid = ac[:, 0] >= 0
    b, _, t = ac.shape
    ac_in = ac.clamp(min=0)
    ac_in[:, level + 1 :] = MASK
    ratio = torch.cos(torch.rand(b, 1, device=ac.device, generator=generator) * math.pi / 2)
    masked = (torch.rand(b, t, device=ac.device, generator=generator) < ratio) & valid
    lvl = ac_in[:, level]
    lvl[masked] = MASK
    ac_in[~valid.unsqueeze(1).expand_as(ac_in)] = MASK
    target = ac[:, level].masked_fill(~masked, -100)
    return ac_in, target, ~valid


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    gen = torch.Generator(device=device)
    gen.manual_seed(0)  # same masks for every evaluation
    for sem, ac in loader:
        sem, ac = sem.to(device), ac.to(device)
        for level in range(N_Q):
            ac_in, target, pad = make_inputs(ac, level, generator=gen)
            logits = model(sem, ac_in, level, pad)
            n = (target != -100).sum().item()
            if n == 0:
                continue
            loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum").item()
            correct += (logits.argmax(-1) == target).sum().item()
            count += n
    stats = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="exp/soundstorm_lite")
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=128, help="global")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=600_000)
    ap.add_argument("--eval-every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(100 + rank)
    torch.manual_seed(100 + rank)

    train_ds = AlignedTokens(args.data, "train", args.frames)
    valid_ds = AlignedTokens(args.data, "valid", args.frames)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, args.batch_size // world, sampler=sampler, num_workers=8, pin_memory=True,
                    drop_last=True, persistent_workers=True)
    vdl = DataLoader(valid_ds, 32, sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True), num_workers=2)

    model = DDP(SoundStormLite(frames=args.frames).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step, epoch, t0 = 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for sem, ac in dl:
            sem, ac = sem.to(device, non_blocking=True), ac.to(device, non_blocking=True)
            level = random.randrange(N_Q)
            ac_in, target, pad = make_inputs(ac, level)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(sem, ac_in, level, pad)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} level {level} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                val_loss, val_acc = evaluate(model.module, vdl, device)
                if rank == 0:
                    print(f"[valid] step {step} loss {val_loss:.4f} top1 {val_acc:.4f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.out, f"step_{step:07d}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
