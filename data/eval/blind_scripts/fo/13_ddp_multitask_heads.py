"""Multi-task fine-tuning of a shared ResNet-50 backbone on several classification
datasets at once (round-robin over tasks), DDP + fp16 autocast + GradScaler.

Each optimizer update accumulates one micro-batch from every task.

torchrun --nproc_per_node=4 13_ddp_multitask_heads.py --config configs/multitask.yaml
"""
import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

DEFAULT_CFG = {
    "tasks": {
        "flowers": {"root": "/data/flowers102", "num_classes": 102},
        "pets": {"root": "/data/oxford_pets", "num_classes": 37},
        "aircraft": {"root": "/data/fgvc_aircraft", "num_classes": 100},
        "cars": {"root": "/data/stanford_cars", "num_classes": 196},
    },
    "batch_size": 32,
    "lr": 0.01,
    "epochs": 50,
    "iters_per_epoch": 500,
    "out_dir": "runs/multitask_r50",
}


class MultiHeadNet(nn.Module):
    def __init__(self, tasks):
        super().__init__()
        backbone = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        backbone.fc = nn.Identity()
        self.backbone = backbone
        self.heads = nn.ModuleDict({
            name: nn.Sequential(nn.Dropout(0.2), nn.Linear(2048, t["num_classes"])) for name, t in tasks.items()
        })

    def forward(self, x, task):
        return self.heads[task](self.backbone(x))


def make_loaders(cfg, rank, world):
    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1)), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    loaders = {}
    for name, t in cfg["tasks"].items():
        tr = torchvision.datasets.ImageFolder(os.path.join(t["root"], "train"), train_tf)
        va = torchvision.datasets.ImageFolder(os.path.join(t["root"], "val"), val_tf)
        tr_sampler = DistributedSampler(tr, shuffle=True, drop_last=True)
        va_subset = torch.utils.data.Subset(va, range(rank, len(va), world))
        loaders[name] = {
            "sampler": tr_sampler,
            "train": DataLoader(tr, batch_size=cfg["batch_size"], sampler=tr_sampler, num_workers=4,
                                pin_memory=True, drop_last=True),
            "val": DataLoader(va_subset, batch_size=100, num_workers=4, pin_memory=True),
        }
    return loaders


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def evaluate(model, loaders, device):
    model.eval()
    results = {}
    for name, l in loaders.items():
        t = torch.zeros(2, device=device)
        for x, y in l["val"]:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(x, name).argmax(-1)
            t += torch.stack([(pred == y).sum().float(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(t)
        results[name] = (100 * t[0] / t[1]).item()
    model.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    loaders = make_loaders(cfg, rank, world)
    streams = {n: infinite(l["train"], l["sampler"]) for n, l in loaders.items()}
    task_names = sorted(cfg["tasks"])

    model = MultiHeadNet(cfg["tasks"]).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    params = [
        {"params": model.module.backbone.parameters(), "lr": cfg["lr"]},
        {"params": model.module.heads.parameters(), "lr": cfg["lr"] * 10},
    ]
    optimizer = torch.optim.SGD(params, momentum=0.9, weight_decay=1e-4)
    total_updates = cfg["epochs"] * cfg["iters_per_epoch"]
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_updates)
    scaler = torch.cuda.amp.GradScaler()

    best_mean = 0.0
    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        for it in range(cfg["iters_per_epoch"]):
            for k, name in enumerate(task_names):
                x, y = next(streams[name])
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                last = k == len(task_names) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = F.cross_entropy(model(x, name), y, label_smoothing=0.1)
                    scaler.scale(loss / len(task_names)).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it} last-task loss {loss.item():.3f} "
                      f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)

        accs = evaluate(model.module, loaders, device)
        mean_acc = sum(accs.values()) / len(accs)
        if rank == 0:
            print(f"epoch {epoch} " + " ".join(f"{k}={v:.2f}" for k, v in accs.items())
                  + f" mean={mean_acc:.2f}", flush=True)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "accs": accs},
                       os.path.join(cfg["out_dir"], "last.pt"))
            if mean_acc > best_mean:
                best_mean = mean_acc
                torch.save(model.module.state_dict(), os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
