"""Three recognition tasks on one EfficientNet-B3: scenes (Places365-standard),
textures (DTD) and traffic signs (GTSRB), each with its own dataset and head.

Each iteration takes one batch from each task loader; task losses are divided
by log(num_classes) so that chance level costs the same for every task.

    torchrun --nproc_per_node=8 train_mt_effnet.py --data /data --epochs 30
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.utils import ModelEmaV2
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets
from torchvision import transforms as T

TASKS = ["places365", "dtd", "gtsrb"]


def transforms(size, train):
    n = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    if train:
        return T.Compose([T.RandomResizedCrop(size, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                          T.TrivialAugmentWide(), T.ToTensor(), n, T.RandomErasing(0.2)])
    return T.Compose([T.Resize(int(size * 1.14)), T.CenterCrop(size), T.ToTensor(), n])


def get_sets(root, size):
    tr = {
        "places365": datasets.Places365(os.path.join(root, "places365"), split="train-standard", small=True,
                                        transform=transforms(size, True)),
        "dtd": datasets.DTD(os.path.join(root, "dtd"), split="train", transform=transforms(size, True)),
        "gtsrb": datasets.GTSRB(os.path.join(root, "gtsrb"), split="train", transform=transforms(size, True)),
    }
    va = {
        "places365": datasets.Places365(os.path.join(root, "places365"), split="val", small=True,
                                        transform=transforms(size, False)),
        "dtd": datasets.DTD(os.path.join(root, "dtd"), split="test", transform=transforms(size, False)),
        "gtsrb": datasets.GTSRB(os.path.join(root, "gtsrb"), split="test", transform=transforms(size, False)),
    }
    return tr, va


class EffNetMT(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.body = timm.create_model("efficientnet_b3.ra2_in1k", pretrained=True, num_classes=0, drop_rate=0.3,
                                      drop_path_rate=0.2)
        self.heads = nn.ModuleDict({t: nn.Linear(self.body.num_features, n) for t, n in n_classes.items()})

    def forward(self, xs):
        sizes = [x.size(0) for x in xs.values()]
        f = self.body(torch.cat(list(xs.values()))).split(sizes)
        return {t: self.heads[t](fi) for t, fi in zip(xs, f)}


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    s = torch.zeros(len(TASKS), 2, device=device)
    for i, t in enumerate(TASKS):
        dl = DataLoader(Subset(val_sets[t], range(rank, len(val_sets[t]), world)), batch_size=200, num_workers=6,
                        pin_memory=True)
        for x, y in dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                p = net.heads[t](net.body(x)).argmax(-1)
            s[i, 0] += (p == y).sum()
            s[i, 1] += len(y)
    dist.all_reduce(s)
    net.train()
    return {t: (s[i, 0] / s[i, 1]).item() for i, t in enumerate(TASKS)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--img_size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=48, help="per task, per GPU")
    ap.add_argument("--lr", type=float, default=0.048, help="RMSprop lr for a global batch of 1536")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default="runs/mt_effnet")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    # torchvision dataset constructors only read the already extracted files here
    train_sets, val_sets = get_sets(args.data, args.img_size)
    n_classes = {"places365": 365, "dtd": 47, "gtsrb": 43}
    norm = {t: math.log(n) for t, n in n_classes.items()}

    loaders = {}
    for t in TASKS:
        sampler = DistributedSampler(train_sets[t], shuffle=True, drop_last=True)
        loaders[t] = DataLoader(train_sets[t], batch_size=args.batch, sampler=sampler, num_workers=5,
                                pin_memory=True, drop_last=True, persistent_workers=True)
    # Places dominates; the small tasks are restarted whenever they run out
    iters_per_epoch = max(len(l) for l in loaders.values())

    net = nn.SyncBatchNorm.convert_sync_batchnorm(EffNetMT(n_classes)).to(device)
    model = DDP(net, device_ids=[local_rank])
    ema = ModelEmaV2(net, decay=0.9998)
    global_batch = args.batch * len(TASKS) * world
    lr = args.lr * global_batch / 1536
    opt = torch.optim.RMSprop(model.parameters(), lr=lr, alpha=0.9, eps=1e-3, momentum=0.9, weight_decay=1e-5)
    total = args.epochs * iters_per_epoch
    warm = 3 * iters_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        its = {t: iter(loaders[t]) for t in TASKS}
        model.train()
        t0 = time.time()
        run = torch.zeros(len(TASKS), device=device)
        for it in range(iters_per_epoch):
            xs, ys = {}, {}
            for t in TASKS:
                try:
                    x, y = next(its[t])
                except StopIteration:
                    its[t] = iter(loaders[t])
                    x, y = next(its[t])
                xs[t], ys[t] = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(xs)
            losses = torch.stack([F.cross_entropy(out[t].float(), ys[t], label_smoothing=0.1) / norm[t] for t in TASKS])
            loss = losses.sum()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net)
            run += losses.detach()

            if (it + 1) % 200 == 0:
                r = run / (it + 1)
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {it + 1}/{iters_per_epoch} " +
                          " ".join(f"{t}={v:.4f}" for t, v in zip(TASKS, r.tolist())) +
                          f" lr={sched.get_last_lr()[0]:.4g} {time.time() - t0:.0f}s", flush=True)

        acc = evaluate(ema.module, val_sets, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} EMA top1 {acc}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "ema": ema.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
