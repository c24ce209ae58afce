"""DomainNet multi-domain training: one ConvNeXt-T trunk, one 345-way head per domain.

Every step draws an equal-size batch from each domain loader (task-balanced),
concatenates them for a single trunk forward, and sums the per-domain losses.
Training can be resumed from the last checkpoint of a preempted job.

    torchrun --nproc_per_node=8 domainnet_mt.py --root /data/domainnet --resume auto
"""
import argparse
import glob
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import Mixup
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torchvision import transforms as T

DOMAINS = ["clipart", "infograph", "painting", "quickdraw", "real", "sketch"]
NUM_CLASSES = 345


class DomainList(Dataset):
    def __init__(self, root, domain, split, transform):
        with open(os.path.join(root, f"{domain}_{split}.txt")) as f:
            self.items = [(os.path.join(root, p), int(c)) for p, c in (l.split() for l in f)]
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, c = self.items[i]
        return self.transform(Image.open(p).convert("RGB")), c


class MultiDomainNet(nn.Module):
    def __init__(self, arch="convnext_tiny.fb_in22k", drop_path=0.2):
        super().__init__()
        self.trunk = timm.create_model(arch, pretrained=True, num_classes=0, drop_path_rate=drop_path)
        self.heads = nn.ModuleList([nn.Linear(self.trunk.num_features, NUM_CLASSES) for _ in DOMAINS])

    def forward(self, x, sizes):
        feats = self.trunk(x).split(sizes)
        return [h(f) for h, f in zip(self.heads, feats)]

    def predict(self, x, d):
        return self.heads[d](self.trunk(x))


def build_loaders(args, world):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tr = T.Compose([T.RandomResizedCrop(224, scale=(0.25, 1.0)), T.RandomHorizontalFlip(),
                    T.ColorJitter(0.3, 0.3, 0.3), T.ToTensor(), norm])
    te = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
    per_domain = args.global_batch // (world * len(DOMAINS))
    train, samplers, test = [], [], []
    for d in DOMAINS:
        ds = DomainList(args.root, d, "train", tr)
        s = DistributedSampler(ds, shuffle=True, drop_last=True)
        train.append(DataLoader(ds, batch_size=per_domain, sampler=s, num_workers=5,
                                pin_memory=True, drop_last=True, persistent_workers=True))
        samplers.append(s)
        vs = DomainList(args.root, d, "test", te)
        shard = Subset(vs, range(dist.get_rank(), len(vs), world))
        test.append(DataLoader(shard, batch_size=128, num_workers=4, pin_memory=True))
    return train, samplers, test


@torch.no_grad()
def evaluate(net, test_loaders, device):
    net.eval()
    res = torch.zeros(len(DOMAINS), 2, device=device)
    for d, loader in enumerate(test_loaders):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = net.predict(x, d).argmax(-1)
            res[d, 0] += (pred == y).sum()
            res[d, 1] += y.numel()
    dist.all_reduce(res)
    net.train()
    return (res[:, 0] / res[:, 1]).tolist()


def find_last(out_dir):
    ckpts = sorted(glob.glob(os.path.join(out_dir, "ckpt_ep*.pth")),
                   key=lambda p: int(p.rsplit("ep", 1)[1].split(".")[0]))
    return ckpts[-1] if ckpts else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="/checkpoints/domainnet_mt")
    ap.add_argument("--global_batch", type=int, default=768)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--iters_per_epoch", type=int, default=1000)
    ap.add_argument("--ema_decay", type=float, default=0.9998)
    ap.add_argument("--resume", default="", help="path, or 'auto' for the newest checkpoint in --out")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    train_loaders, samplers, test_loaders = build_loaders(args, world)

    net = MultiDomainNet().to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = ModelEmaV2(net, decay=args.ema_decay)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    total = args.epochs * args.iters_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.05,
                                                div_factor=100.0, final_div_factor=100.0)
    scaler = torch.cuda.amp.GradScaler()
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=NUM_CLASSES)

    start_epoch = 0
    resume = find_last(args.out) if args.resume == "auto" else args.resume
    if resume:
        checkpoint = torch.load(resume)
        net.load_state_dict(checkpoint["model"])
        ema.module.load_state_dict(checkpoint["ema"])
        opt.load_state_dict(checkpoint["optimizer"])
        sched.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        start_epoch = checkpoint["epoch"] + 1
        if rank == 0:
            print(f"resumed from {resume} at epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        streams = [iter(l) for l in train_loaders]
        model.train()
        tic = time.time()
        for it in range(args.iters_per_epoch):
            xs, ys = [], []
            for d in range(len(DOMAINS)):
                try:
                    x, y = next(streams[d])
                except StopIteration:
                    streams[d] = iter(train_loaders[d])
                    x, y = next(streams[d])
                x, y = mixup(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                xs.append(x)
                ys.append(y)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(torch.cat(xs), [x.size(0) for x in xs])
                losses = [torch.sum(-y * F.log_softmax(l.float(), -1), -1).mean() for l, y in zip(logits, ys)]
                loss = sum(losses) / len(losses)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net)

            if it % 100 == 0:
                l = torch.stack([v.detach() for v in losses])
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {it} " + " ".join(f"{d}={v:.3f}" for d, v in zip(DOMAINS, l.tolist())),
                          flush=True)

        acc = evaluate(ema.module, test_loaders, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - tic:.0f}s) EMA acc " +
                  " ".join(f"{d}={a:.4f}" for d, a in zip(DOMAINS, acc)) + f" avg={sum(acc) / len(acc):.4f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "ema": ema.module.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, f"ckpt_ep{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
