"""Optuna HPO for EuroSAT land-cover classification (ResNet-18, ImageNet init),
each trial data-parallel over all GPUs, then test-set evaluation of the best
trial's weights and export for the inference service.

    torchrun --nproc_per_node=4 hpo_eurosat.py --root /data/EuroSAT_RGB --trials 30
"""
import argparse
import json
import os

import optuna
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/EuroSAT_RGB")
    p.add_argument("--out", default="runs/hpo_eurosat")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--per-gpu-batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def build_model(params, n_classes, pretrained=True):
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1 if pretrained else None
    m = torchvision.models.resnet18(weights=weights)
    m.fc = nn.Sequential(nn.Dropout(params["dropout"]), nn.Linear(512, n_classes))
    return m


def splits(root, seed):
    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tr_tf = T.Compose([T.RandomResizedCrop(64, scale=(0.6, 1.0)), T.RandomHorizontalFlip(),
                       T.RandomVerticalFlip(), T.ToTensor(), norm])
    ev_tf = T.Compose([T.ToTensor(), norm])
    full_tr = torchvision.datasets.ImageFolder(root, tr_tf)
    full_ev = torchvision.datasets.ImageFolder(root, ev_tf)
    perm = torch.randperm(len(full_tr), generator=torch.Generator().manual_seed(seed)).tolist()
    n = len(perm)
    tr, va, te = perm[: int(0.7 * n)], perm[int(0.7 * n): int(0.85 * n)], perm[int(0.85 * n):]
    return Subset(full_tr, tr), Subset(full_ev, va), Subset(full_ev, te), len(full_tr.classes)


@torch.no_grad()
def accuracy(model, ds, device, rank, world):
    model.eval()
    shard = Subset(ds, list(range(rank, len(ds), world)))
    c = torch.zeros(2, device=device)
    for x, y in DataLoader(shard, batch_size=256, num_workers=4):
        x, y = x.to(device), y.to(device)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    if world > 1:
        dist.all_reduce(c)
    return (c[0] / c[1]).item()


def train(params, train_ds, val_ds, n_classes, args, rank, world, device):
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.per_gpu_batch, sampler=sampler, num_workers=6,
                        pin_memory=True, drop_last=True)
    model = DDP(build_model(params, n_classes).to(device), device_ids=[device.index])
    backbone = [p for n, p in model.named_parameters() if not n.startswith("module.fc")]
    head = [p for n, p in model.named_parameters() if n.startswith("module.fc")]
    opt = torch.optim.SGD([{"params": backbone, "lr": params["lr"] * params["backbone_mult"]},
                           {"params": head, "lr": params["lr"]}],
                          momentum=0.9, weight_decay=params["weight_decay"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y, label_smoothing=params["smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return model, accuracy(model.module, val_ds, device, rank, world)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds, test_ds, n_classes = splits(args.root, args.seed)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torchvision.models.resnet18(weights=torchvision.models.ResNet18_Weights.IMAGENET1K_V1)
        study = optuna.create_study(direction="maximize",
                                    sampler=optuna.samplers.TPESampler(seed=args.seed, multivariate=True))
    dist.barrier()

    best_val = -1.0
    for _ in range(args.trials):
        box = [None]
        if rank == 0:
            trial = study.ask()
            box[0] = {"lr": trial.suggest_float("lr", 1e-3, 0.1, log=True),
                      "backbone_mult": trial.suggest_float("backbone_mult", 0.05, 1.0, log=True),
                      "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-3, log=True),
                      "dropout": trial.suggest_float("dropout", 0.0, 0.5),
                      "smoothing": trial.suggest_float("smoothing", 0.0, 0.2)}
        dist.broadcast_object_list(box, src=0)
        params = box[0]
        model, val_acc = train(params, train_ds, val_ds, n_classes, args, rank, world, device)
        if rank == 0:
            study.tell(trial, val_acc)
            print(f"trial {trial.number}: val {val_acc:.4f} {params}", flush=True)
            if val_acc > best_val:
                best_val = val_acc
                torch.save(model.state_dict(), os.path.join(args.out, "best_weights.pt"))
                with open(os.path.join(args.out, "best_params.json"), "w") as f:
                    json.dump({"params": params, "val_acc": val_acc, "trial": trial.number}, f, indent=2)
        dist.barrier()
        del model

    if rank == 0:
        with open(os.path.join(args.out, "best_params.json")) as f:
            best = json.load(f)
        net = build_model(best["params"], n_classes, pretrained=False)
        net.load_state_dict(torch.load(os.path.join(args.out, "best_weights.pt"), map_location="cpu"))
        net = net.to(device)
        test_acc = accuracy(net, test_ds, device, rank=0, world=1)
        print(f"best trial {best['trial']}: val {best['val_acc']:.4f} test {test_acc:.4f}", flush=True)
        net.eval()
        scripted = torch.jit.trace(net.cpu(), torch.randn(1, 3, 64, 64))
        scripted.save(os.path.join(args.out, "eurosat_resnet18.ts"))
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump({**best, "test_acc": test_acc}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
