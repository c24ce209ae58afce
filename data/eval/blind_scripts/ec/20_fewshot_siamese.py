"""Siamese golden-sample comparison for label / print inspection.

Every product variant has a golden reference image. The network sees
(reference, candidate) pairs and predicts whether the candidate deviates
from the reference, so new variants need no retraining - only a new golden
image. Started directly with python; one process per visible GPU.

    python 20_fewshot_siamese.py --pairs /data/labels/pairs_v3.jsonl --img-root /data/labels/img \
        --out /shared/labels/siamese --gpus 4
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True, help="jsonl: {ref, cand, deviates, split}")
    p.add_argument("--img-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--size", type=int, default=192)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="pairs per GPU")
    p.add_argument("--lr", type=float, default=3e-4, help="single-GPU lr, scaled with the number of GPUs")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--port", default="29533")
    return p.parse_args()


class PairDataset(Dataset):
    def __init__(self, pairs, img_root, size, train):
        self.pairs, self.root = pairs, img_root
        aug = [transforms.RandomAffine(3, translate=(0.02, 0.02), scale=(0.97, 1.03)),
               transforms.ColorJitter(0.15, 0.15)] if train else []
        self.tf = transforms.Compose([transforms.Resize((size, size))] + aug + [transforms.ToTensor()])

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        rec = self.pairs[i]
        ref = self.tf(Image.open(os.path.join(self.root, rec["ref"])).convert("RGB"))
        cand = self.tf(Image.open(os.path.join(self.root, rec["cand"])).convert("RGB"))
        return ref, cand, torch.tensor(float(rec["deviates"]))


def conv_gn(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(16, cout), nn.GELU())


class SiameseNet(nn.Module):
    def __init__(self, width=64, emb=256):
        super().__init__()
        w = width
        self.embed = nn.Sequential(conv_gn(3, w, 2), conv_gn(w, w, 1), conv_gn(w, 2 * w, 2), conv_gn(2 * w, 2 * w, 1),
                                   conv_gn(2 * w, 4 * w, 2), conv_gn(4 * w, 4 * w, 1), conv_gn(4 * w, emb, 2))
        self.compare = nn.Sequential(nn.Conv2d(3 * emb, emb, 1), nn.GELU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
                                     nn.Linear(emb, 1))

    def forward(self, ref, cand):
        a, b = self.embed(ref), self.embed(cand)
        return self.compare(torch.cat([a, b, (a - b).abs()], 1)).squeeze(1)


def load_pairs(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "val"]


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)

    train_pairs, val_pairs = load_pairs(args.pairs)
    # one fixed shuffle for everybody, then disjoint strided shards (lengths may differ by one)
    random.Random(args.seed).shuffle(train_pairs)
    my_train = train_pairs[rank::world_size]
    my_val = val_pairs[rank::world_size]

    train_ds = PairDataset(my_train, args.img_root, args.size, train=True)
    val_ds = PairDataset(my_val, args.img_root, args.size, train=False)
    g = torch.Generator()
    g.manual_seed(args.seed * 100 + rank)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, generator=g,
                          num_workers=args.workers, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=64, num_workers=args.workers, pin_memory=True)

    torch.manual_seed(args.seed)
    model = DDP(SiameseNet().to(device), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr * world_size, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    pos_weight = torch.tensor(3.0, device=device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_pairs)} train pairs, {len(val_pairs)} val pairs, {world_size} GPUs", flush=True)

    best_f1 = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(2, device=device)
        # shards differ in length, so some ranks run out of batches first
        with Join([model]):
            for ref, cand, y in train_dl:
                ref, cand, y = ref.to(device, non_blocking=True), cand.to(device, non_blocking=True), y.to(device)
                loss = F.binary_cross_entropy_with_logits(model(ref, cand), y, pos_weight=pos_weight)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                stats += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=device)])
        sched.step()
        dist.all_reduce(stats)

        model.eval()
        conf = torch.zeros(4, device=device)  # tp, fp, fn, tn
        with torch.no_grad():
            for ref, cand, y in val_dl:
                pred = model.module(ref.to(device), cand.to(device)) > 0
                y = y.to(device).bool()
                conf += torch.stack([(pred & y).sum(), (pred & ~y).sum(), (~pred & y).sum(),
                                     (~pred & ~y).sum()]).float()
        dist.all_reduce(conf)
        tp, fp, fn, tn = conf.tolist()
        precision = tp / max(tp + fp, 1)
        recall = tp / max(tp + fn, 1)
        f1 = 2 * precision * recall / max(precision + recall, 1e-8)

        if rank == 0:
            print(f"epoch {epoch:2d} loss {(stats[0] / stats[1]).item():.4f} | val P {precision:.3f} "
                  f"R {recall:.3f} F1 {f1:.3f} (n={int(tp + fp + fn + tn)}) | {time.time() - t0:.0f}s", flush=True)
            if f1 > best_f1:
                best_f1 = f1
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "f1": f1, "size": args.size},
                           os.path.join(args.out, "siamese_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


def main():
    args = get_args()
    world_size = args.gpus
    assert 0 < world_size <= torch.cuda.device_count(), "not enough visible GPUs"
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
