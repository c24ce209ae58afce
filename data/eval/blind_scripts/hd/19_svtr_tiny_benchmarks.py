"""SVTR-Tiny style recognizer (CTC) trained on MJ+ST, evaluated on the six common benchmarks.

    torchrun --nproc_per_node=4 19_svtr_tiny_benchmarks.py --train /data/lmdb/train/MJ /data/lmdb/train/ST \
        --bench-root /data/lmdb/evaluation --out runs/svtr_tiny
"""
import argparse
import io
import os
import time

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

BENCHMARKS = ["IIIT5k_3000", "SVT", "IC13_857", "IC15_1811", "SVTP", "CUTE80"]
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def arguments():
    a = argparse.ArgumentParser()
    a.add_argument("--train", nargs="+", required=True)
    a.add_argument("--bench-root", required=True)
    a.add_argument("--out", default="runs/svtr_tiny")
    a.add_argument("--bs", type=int, default=256)
    a.add_argument("--epochs", type=int, default=20)
    a.add_argument("--lr", type=float, default=5e-4)
    a.add_argument("--warmup-epochs", type=int, default=2)
    a.add_argument("--workers", type=int, default=8)
    return a.parse_args()


class LMDBSet(Dataset):
    def __init__(self, root, augment):
        self.root = root
        env = lmdb.open(root, readonly=True, lock=False)
        with env.begin() as txn:
            self.n = int(txn.get(b"num-samples"))
        env.close()
        self.env = None
        self.tf = T.Compose(([T.RandomApply([T.RandomAffine(10, shear=15)], p=0.4),
                              T.RandomApply([T.GaussianBlur(3)], p=0.2)] if augment else []) +
                            [T.Resize((32, 100)), T.ToTensor(), T.Normalize(0.5, 0.5)])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.root, readonly=True, lock=False, readahead=False, max_readers=32)
        with self.env.begin() as txn:
            label = txn.get(b"label-%09d" % (i + 1)).decode("utf-8").lower()
            img = Image.open(io.BytesIO(txn.get(b"image-%09d" % (i + 1)))).convert("RGB")
        label = "".join(ch for ch in label if ch in ALPHABET)[:25]
        return self.tf(img), label


def collate(batch):
    imgs, labels = zip(*batch)
    return torch.stack(imgs), list(labels)


def encode(labels):
    flat = [ALPHABET.index(c) + 1 for s in labels for c in s]
    return torch.tensor(flat, dtype=torch.long), torch.tensor([len(s) for s in labels], dtype=torch.long)


class MixingBlock(nn.Module):
    def __init__(self, dim, heads, local, hw):
        super().__init__()
        self.local, self.hw = local, hw
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim))
        if local:
            h, w = hw
            idx = torch.arange(h * w)
            r, c = idx // w, idx % w
            far = ((r[:, None] - r[None]).abs() > 3) | ((c[:, None] - c[None]).abs() > 5)
            self.register_buffer("mask", far, persistent=False)
        else:
            self.mask = None

    def forward(self, x):
        y = self.norm1(x)
        x = x + self.attn(y, y, y, attn_mask=self.mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class SVTRTiny(nn.Module):
    def __init__(self, n_cls, dims=(64, 128, 256), depths=(3, 6, 3), heads=(2, 4, 8)):
        super().__init__()
        self.embed = nn.Sequential(nn.Conv2d(3, dims[0] // 2, 3, 2, 1), nn.BatchNorm2d(dims[0] // 2), nn.GELU(),
                                   nn.Conv2d(dims[0] // 2, dims[0], 3, 2, 1), nn.BatchNorm2d(dims[0]), nn.GELU())
        hw = (8, 25)
        self.pos = nn.Parameter(torch.zeros(1, hw[0] * hw[1], dims[0]))
        self.stages = nn.ModuleList()
        self.merges = nn.ModuleList()
        for i, (d, n, h) in enumerate(zip(dims, depths, heads)):
            self.stages.append(nn.ModuleList([MixingBlock(d, h, local=(i == 0 or (i == 1 and j < 3)), hw=hw)
                                              for j in range(n)]))
            if i < 2:
                self.merges.append(nn.Conv2d(d, dims[i + 1], 3, (2, 1), 1))
                hw = (hw[0] // 2, hw[1])
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], n_cls)
        self.hw0 = (8, 25)

    def forward(self, x):
        x = self.embed(x)
        b, c, h, w = x.shape
        x = x.flatten(2).transpose(1, 2) + self.pos
        for i, blocks in enumerate(self.stages):
            for blk in blocks:
                x = blk(x)
            if i < 2:
                x = x.transpose(1, 2).reshape(b, -1, h, w)
                x = self.merges[i](x)
                h = x.shape[2]
                x = x.flatten(2).transpose(1, 2)
        x = self.norm(x)
        x = x.reshape(b, h, w, -1).mean(1)  # B, W, C
        return self.head(x)


def ctc_decode(logits):
    res = []
    for row in logits.argmax(-1).tolist():
        s, prev = [], 0
        for k in row:
            if k != prev and k != 0:
                s.append(ALPHABET[k - 1])
            prev = k
        res.append("".join(s))
    return res


@torch.no_grad()
def eval_benchmark(net, root, rank, world, device):
    ds = LMDBSet(root, augment=False)
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), 256, num_workers=4, collate_fn=collate)
    correct = total = 0
    for img, labels in loader:
        preds = ctc_decode(net(img.to(device)))
        correct += sum(int(p == l) for p, l in zip(preds, labels))
        total += len(labels)
    counts = torch.tensor([correct, total], dtype=torch.long)
    dist.all_reduce(counts)
    return counts[0].item(), counts[1].item()


def main():
    args = arguments()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_set = ConcatDataset([LMDBSet(r, augment=True) for r in args.train])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers, pin_memory=True,
                        drop_last=True, collate_fn=collate)

    model = DDP(SVTRTiny(len(ALPHABET) + 1).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.05)
    iters = len(loader)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, total_iters=args.warmup_epochs * iters),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=(args.epochs - args.warmup_epochs) * iters),
    ], milestones=[args.warmup_epochs * iters])
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_avg = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (img, labels) in enumerate(loader):
            img = img.to(device, non_blocking=True)
            targets, tlen = encode(labels)
            lp = F.log_softmax(model(img), -1).transpose(0, 1)
            loss = ctc(lp, targets, torch.full((img.size(0),), lp.size(0), dtype=torch.long), tlen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"[{epoch}][{i}/{iters}] ctc {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        model.module.eval()
        results, tot_c, tot_n = {}, 0, 0
        for name in BENCHMARKS:
            c, n = eval_benchmark(model.module, os.path.join(args.bench_root, name), rank, world, device)
            results[name] = c / max(n, 1)
            tot_c, tot_n = tot_c + c, tot_n + n
        model.module.train()
        avg = tot_c / max(tot_n, 1)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) " +
                  " ".join(f"{k}={v * 100:.2f}" for k, v in results.items()) + f" | avg {avg * 100:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "results": results},
                       os.path.join(args.out, "last.pth"))
            if avg > best_avg:
                best_avg = avg
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "results": results},
                           os.path.join(args.out, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
