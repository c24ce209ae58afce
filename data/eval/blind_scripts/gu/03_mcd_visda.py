"""Maximum Classifier Discrepancy (Saito et al., CVPR'18) on VisDA-2017, DDP.

Generator G (ResNet-101 trunk) and two classifiers F1 / F2, each in its own DDP
wrapper.  Every iteration runs the three MCD steps:
  A. train G, F1, F2 on labelled source
  B. fix G, train F1/F2 to maximise their disagreement on target
  C. fix F1/F2, train G to minimise the disagreement (num_k times)

    torchrun --nproc_per_node=8 03_mcd_visda.py --root data/visda-2017
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms

CLASSES = ["aeroplane", "bicycle", "bus", "car", "horse", "knife", "motorcycle",
           "person", "plant", "skateboard", "train", "truck"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/visda-2017")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--num-k", type=int, default=4)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default="checkpoints/mcd_visda")
    p.add_argument("--resume", default="")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class VisDAList(Dataset):
    def __init__(self, split_dir, transform):
        self.split_dir = split_dir
        self.transform = transform
        with open(os.path.join(split_dir, "image_list.txt")) as f:
            self.items = [(a, int(b)) for a, b in (l.split() for l in f if l.strip())]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        img = Image.open(os.path.join(self.split_dir, path)).convert("RGB")
        return self.transform(img), y


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        r = models.resnet101(weights=models.ResNet101_Weights.IMAGENET1K_V1)
        r.fc = nn.Identity()
        self.net = r

    def forward(self, x):
        return self.net(x)


class Classifier(nn.Module):
    def __init__(self, in_dim=2048, hidden=1000, num_classes=12, p=0.5):
        super().__init__()
        self.net = nn.Sequential(
            nn.Dropout(p), nn.Linear(in_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Dropout(p), nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.net(x)


def discrepancy(a, b):
    return (F.softmax(a, 1) - F.softmax(b, 1)).abs().mean()


@torch.no_grad()
def evaluate(G, F1, F2, dataset, device, rank, world_size, batch_size, workers):
    """Every rank scores a disjoint strided shard; confusion matrices are summed."""
    G.eval(); F1.eval(); F2.eval()
    shard = Subset(dataset, list(range(rank, len(dataset), world_size)))
    loader = DataLoader(shard, batch_size=batch_size * 2, num_workers=workers, pin_memory=True)
    n = len(CLASSES)
    conf = torch.zeros(n, n, dtype=torch.long, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        feat = G(x)
        pred = (F1(feat).softmax(1) + F2(feat).softmax(1)).argmax(1)
        conf += torch.bincount(y * n + pred, minlength=n * n).view(n, n)
    dist.all_reduce(conf)
    per_class = conf.diag().float() / conf.sum(1).clamp(min=1).float()
    G.train(); F1.train(); F2.train()
    return per_class.mean().item() * 100, per_class.tolist()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.RandomCrop(224),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize((256, 256)), transforms.CenterCrop(224),
                                  transforms.ToTensor(), norm])
    source = VisDAList(os.path.join(args.root, "train"), train_tf)
    target = VisDAList(os.path.join(args.root, "validation"), train_tf)
    target_eval = VisDAList(os.path.join(args.root, "validation"), test_tf)

    s_sampler = DistributedSampler(source, shuffle=True, seed=args.seed, drop_last=True)
    t_sampler = DistributedSampler(target, shuffle=True, seed=args.seed, drop_last=True)
    s_loader = DataLoader(source, args.batch_size, sampler=s_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    t_loader = DataLoader(target, args.batch_size, sampler=t_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)

    G = Generator().to(device)
    F1 = Classifier().to(device)
    F2 = Classifier().to(device)
    start_epoch, best = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ck["G"]); F1.load_state_dict(ck["F1"]); F2.load_state_dict(ck["F2"])
        start_epoch, best = ck["epoch"] + 1, ck.get("best", 0.0)

    G = DDP(G, device_ids=[local_rank])
    F1 = DDP(F1, device_ids=[local_rank])
    F2 = DDP(F2, device_ids=[local_rank])

    opt_g = torch.optim.SGD(G.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    opt_f = torch.optim.SGD(list(F1.parameters()) + list(F2.parameters()), lr=args.lr,
                            momentum=0.9, weight_decay=5e-4)
    if args.resume:
        opt_g.load_state_dict(ck["opt_g"]); opt_f.load_state_dict(ck["opt_f"])

    def reset_grad():
        opt_g.zero_grad(set_to_none=True)
        opt_f.zero_grad(set_to_none=True)

    steps_per_epoch = min(len(s_loader), len(t_loader))
    for epoch in range(start_epoch, args.epochs):
        s_sampler.set_epoch(epoch)
        t_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, ((xs, ys), (xt, _)) in enumerate(zip(s_loader, t_loader)):
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            xt = xt.to(device, non_blocking=True)

            # Step A: source classification for G, F1, F2
            reset_grad()
            feat_s = G(xs)
            loss_s = F.cross_entropy(F1(feat_s), ys) + F.cross_entropy(F2(feat_s), ys)
            loss_s.backward()
            opt_g.step(); opt_f.step()

            # Step B: G fixed; classifiers keep source accuracy and maximise target discrepancy
            reset_grad()
            with torch.no_grad():
                feat = G(torch.cat([xs, xt]))
            out1, out2 = F1(feat), F2(feat)
            ns = xs.size(0)
            loss_b = (F.cross_entropy(out1[:ns], ys) + F.cross_entropy(out2[:ns], ys)
                      - discrepancy(out1[ns:], out2[ns:]))
            loss_b.backward()
            opt_f.step()

            # Step C: classifiers fixed; G minimises the discrepancy
            for _ in range(args.num_k):
                reset_grad()
                feat_t = G(xt)
                loss_dis = discrepancy(F1(feat_t), F2(feat_t))
                loss_dis.backward()
                opt_g.step()

            if i % 50 == 0:
                logs = torch.stack([loss_s.detach(), loss_b.detach(), loss_dis.detach()])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[{epoch}][{i}/{steps_per_epoch}] src {logs[0]:.3f} "
                          f"B {logs[1]:.3f} dis {logs[2]:.4f} ({time.time() - t0:.0f}s)", flush=True)

        mean_acc, per_class = evaluate(G.module, F1.module, F2.module, target_eval, device,
                                       rank, world_size, args.batch_size, args.workers)
        if rank == 0:
            print(f"epoch {epoch} mean-class acc {mean_acc:.2f} | "
                  + " ".join(f"{c[:4]}:{a * 100:.1f}" for c, a in zip(CLASSES, per_class)), flush=True)
            best = max(best, mean_acc)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"epoch": epoch, "best": best,
                        "G": G.module.state_dict(), "F1": F1.module.state_dict(),
                        "F2": F2.module.state_dict(),
                        "opt_g": opt_g.state_dict(), "opt_f": opt_f.state_dict()},
                       os.path.join(args.out, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
