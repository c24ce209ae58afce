"""Online HuBERT: targets come from a frozen teacher (snapshot of the student)
and a GPU k-means codebook that is re-fitted every `--refresh-epochs` epochs on
teacher features gathered from all ranks.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29400 \
        14_hubert_online_kmeans.py --data /shared/ls960 --out /shared/exp/online_hubert
"""
import argparse
import copy
import logging
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("online_hubert")
CONV = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def frames(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


class Student(nn.Module):
    def __init__(self, k, d=768, depth=12):
        super().__init__()
        layers, c = [], 1
        for i, (o, kk, s) in enumerate(CONV):
            layers += [nn.Conv1d(c, o, kk, s, bias=False)] + ([nn.GroupNorm(o, o)] if i == 0 else []) + [nn.GELU()]
            c = o
        self.cnn = nn.Sequential(*layers)
        self.cnn_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.ln = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True)
                                     for _ in range(depth)])
        self.head = nn.Linear(d, 256)
        self.label_embs = nn.Parameter(torch.empty(k, 256).uniform_())

    def encode(self, wav, mask=None, upto=None):
        f = self.cnn_ln(self.cnn(wav[:, None]).transpose(1, 2))
        x = self.proj(f)
        if mask is not None:
            x = torch.where(mask[..., None], self.mask_emb.to(x.dtype), x)
        x = self.ln(x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        for i, b in enumerate(self.blocks):
            x = b(x)
            if upto is not None and i + 1 == upto:
                break
        return x, f.float().pow(2).mean()

    def forward(self, wav, mask):
        x, pen = self.encode(wav, mask)
        h = F.normalize(self.head(x).float(), dim=-1)
        return h @ F.normalize(self.label_embs.float(), dim=-1).T / 0.1, pen


class AudioSet(Dataset):
    def __init__(self, tsv, crop=250000, min_len=32000):
        with open(tsv) as f:
            root = f.readline().strip()
            self.paths = [os.path.join(root, p) for p, n in (l.split("\t") for l in f.read().splitlines())
                          if int(n) >= min_len]
        self.crop = crop

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        w, _ = sf.read(self.paths[i], dtype="float32")
        if len(w) > self.crop:
            s = random.randint(0, len(w) - self.crop)
            w = w[s:s + self.crop]
        return torch.from_numpy(w)


def crop_to_shortest(batch):
    n = min(len(w) for w in batch)
    return torch.stack([w[:n] for w in batch])


def spans(B, T, p=0.8, L=10):
    m = torch.zeros(B, T, dtype=torch.bool)
    k = int(p * T / L + random.random())
    for b in range(B):
        for s in random.sample(range(T - L), k):
            m[b, s:s + L] = True
    return m


@torch.no_grad()
def kmeans(X, k, iters, seed):
    g = torch.Generator(device=X.device).manual_seed(seed)
    C = X[torch.randperm(X.size(0), generator=g, device=X.device)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(X, C).argmin(1)
        sums = torch.zeros_like(C).index_add_(0, assign, X)
        cnt = torch.bincount(assign, minlength=k).clamp(min=1).unsqueeze(1).to(X.dtype)
        C = sums / cnt
    return C


@torch.no_grad()
def refit_codebook(teacher, loader, args, dev, world, seed):
    chunks = []
    for i, wav in enumerate(loader):
        if i == args.km_batches:
            break
        h, _ = teacher.encode(wav.to(dev), upto=args.teacher_layer)
        chunks.append(h[:, ::args.km_stride].reshape(-1, h.size(-1)).float())
    feats = torch.cat(chunks)
    gathered = [torch.empty_like(feats) for _ in range(world)]
    dist.all_gather(gathered, feats)
    X = torch.cat(gathered)
    C = kmeans(X, args.k, args.km_iters, seed)
    dist.broadcast(C, src=0)
    return C, X.size(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--teacher-layer", type=int, default=9)
    ap.add_argument("--refresh-epochs", type=int, default=20)
    ap.add_argument("--km-batches", type=int, default=16)
    ap.add_argument("--km-stride", type=int, default=2)
    ap.add_argument("--km-iters", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=20000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    train = AudioSet(os.path.join(args.data, "train.tsv"))
    valid = AudioSet(os.path.join(args.data, "valid.tsv"))
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, args.bs, sampler=sampler, collate_fn=crop_to_shortest, num_workers=8,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(torch.utils.data.Subset(valid, range(rank, len(valid), world)), args.bs,
                         collate_fn=crop_to_shortest, num_workers=2)

    student = Student(args.k).to(dev)
    model = DDP(student, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / args.warmup_steps if s < args.warmup_steps else max(0.0, (total - s) / (total - args.warmup_steps)))
    os.makedirs(args.out, exist_ok=True)

    teacher, C = None, None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        if epoch % args.refresh_epochs == 0:
            teacher = copy.deepcopy(student).eval().requires_grad_(False)
            C, n = refit_codebook(teacher, loader, args, dev, world, seed=epoch)
            log.info("epoch %d: refitted %d-means on %d teacher frames", epoch, args.k, n)
        model.train()
        t0 = time.time()
        for it, wav in enumerate(loader):
            wav = wav.to(dev, non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                h, _ = teacher.encode(wav, upto=args.teacher_layer)
            targets = torch.cdist(h.float(), C[None]).argmin(-1)
            mask = spans(wav.size(0), targets.size(1)).to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, pen = model(wav, mask)
            loss = F.cross_entropy(logits[mask], targets[mask]) + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            if it % 200 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                log.info("ep %d it %d loss %.4f lr %.2e %.2fs/it", epoch, it, l.item(), sched.get_last_lr()[0],
                         (time.time() - t0) / max(it, 1))

        student.eval()
        s = torch.zeros(2, device=dev)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for wav in vloader:
                wav = wav.to(dev)
                h, _ = teacher.encode(wav, upto=args.teacher_layer)
                tgt = torch.cdist(h.float(), C[None]).argmin(-1)
                mask = spans(wav.size(0), tgt.size(1)).to(dev)
                logits, _ = student(wav, mask)
                s += torch.stack([(logits[mask].argmax(-1) == tgt[mask]).sum(), mask.sum()]).float()
        dist.all_reduce(s)
        log.info("epoch %d valid acc_m %.4f", epoch, (s[0] / s[1]).item())

        if rank == 0:
            torch.save({"model": student.state_dict(), "codebook": C.cpu(), "teacher": teacher.state_dict(),
                        "opt": opt.state_dict(), "epoch": epoch}, os.path.join(args.out, "checkpoint_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
