"""DomainNet multi-domain training with one classifier per domain.

Six domains (clipart, infograph, painting, quickdraw, real, sketch) of very different
sizes share a ConvNeXt-T trunk. One batch of every domain per step.
Single node, started with mp.spawn (no torchrun on this cluster image):

    python 16_domainnet_spawn_multihead.py --root /data/domainnet --out runs/domainnet_mh
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import timm
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
N_CLASSES = 345


class DomainList(Dataset):
    """Reads the official <domain>_<split>.txt lists: '<relpath> <label>' per line."""

    def __init__(self, root, domain, split, tf):
        self.root, self.tf = root, tf
        with open(os.path.join(root, f"{domain}_{split}.txt")) as f:
            self.items = [(p, int(l)) for p, l in (line.split() for line in f)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, y = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, p)).convert("RGB")), y


class MultiHead(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.trunk = timm.create_model(arch, pretrained=True, num_classes=0)
        self.heads = nn.ModuleList([nn.Linear(self.trunk.num_features, N_CLASSES) for _ in DOMAINS])

    def forward(self, x, counts):
        f = self.trunk(x)
        return [h(part) for h, part in zip(self.heads, f.split(counts))]


def cycle(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def evaluate(net, test_sets, device, rank, world):
    net.eval()
    acc = torch.zeros(len(DOMAINS), 2, device=device)
    for k, ds in enumerate(test_sets):
        for x, y in DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=256, num_workers=6):
            x, y = x.to(device), y.to(device)
            counts = [x.size(0) if j == k else 0 for j in range(len(DOMAINS))]
            acc[k, 0] += (net(x, counts)[k].argmax(1) == y).sum()
            acc[k, 1] += y.numel()
    dist.all_reduce(acc)
    net.train()
    return {d: (acc[k, 0] / acc[k, 1]).item() for k, d in enumerate(DOMAINS)}


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)

    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tf_tr = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    tf_te = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    train_sets = [DomainList(args.root, d, "train", tf_tr) for d in DOMAINS]
    test_sets = [DomainList(args.root, d, "test", tf_te) for d in DOMAINS]
    streams = []
    for ds in train_sets:
        s = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
        dl = DataLoader(ds, batch_size=args.bs, sampler=s, num_workers=3, pin_memory=True,
                        drop_last=True, persistent_workers=True)
        streams.append(cycle(dl, s))

    model = DDP(MultiHead(args.arch).to(device), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * args.steps_per_epoch)

    start_epoch, best, bad_epochs = 0, 0.0, 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=f"cuda:{rank}")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best, bad_epochs = ck["epoch"] + 1, ck["best"], ck["bad_epochs"]

    for epoch in range(start_epoch, args.epochs):
        t0 = time.time()
        for it in range(args.steps_per_epoch):
            batches = [next(s) for s in streams]
            x = torch.cat([b[0] for b in batches]).to(device, non_blocking=True)
            ys = [b[1].to(device, non_blocking=True) for b in batches]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outs = model(x, [b[0].size(0) for b in batches])
            loss = sum(F.cross_entropy(o.float(), y) for o, y in zip(outs, ys)) / len(DOMAINS)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        acc = evaluate(model.module, test_sets, device, rank, world_size)
        mean_acc = sum(acc.values()) / len(acc)

        # rank 0 decides about early stopping, everyone follows
        stop = torch.zeros(1, device=device)
        if rank == 0:
            if mean_acc > best:
                best, bad_epochs = mean_acc, 0
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_model.pt"))
            else:
                bad_epochs += 1
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best, "bad_epochs": bad_epochs}, ckpt_path)
            print(json.dumps({"epoch": epoch, "sec": round(time.time() - t0), "mean": mean_acc, **acc}), flush=True)
            stop.fill_(float(bad_epochs >= args.patience))
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="convnext_tiny.fb_in22k")
    ap.add_argument("--bs", type=int, default=24, help="per domain, per GPU")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--steps_per_epoch", type=int, default=1500)
    ap.add_argument("--patience", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    world_size = torch.cuda.device_count()
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
