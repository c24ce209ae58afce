"""Grid search over label smoothing x learning rate x weight decay on CIFAR-10.

Each GPU runs its own independent trials (no gradient sharing): the grid is
dealt round-robin to one process per GPU. Results go to one json file per trial.

    python 15_ls_grid_per_gpu.py --grid configs/ls_grid.yaml --out sweeps/ls_grid
"""
import argparse
import itertools
import json
import os
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
import wandb
import yaml
from torch.utils.data import DataLoader, random_split


def expand_grid(grid):
    keys = sorted(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield dict(zip(keys, values))


def resnet20(num_classes=10):
    def block(cin, cout, stride):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )

    class Res(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.f = block(cin, cout, stride)
            self.s = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            return F.relu(self.f(x) + self.s(x))

    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    cin = 16
    for cout, stride in [(16, 1), (32, 2), (64, 2)]:
        for i in range(3):
            layers.append(Res(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


def get_datasets(root, val_size, split_seed):
    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    eval_tf = T.Compose([T.ToTensor(), norm])
    full_train = torchvision.datasets.CIFAR10(root, train=True, transform=train_tf)
    full_eval = torchvision.datasets.CIFAR10(root, train=True, transform=eval_tf)
    g = torch.Generator().manual_seed(split_seed)
    train_idx, val_idx = random_split(range(len(full_train)), [len(full_train) - val_size, val_size],
                                      generator=g)
    train = torch.utils.data.Subset(full_train, list(train_idx))
    val = torch.utils.data.Subset(full_eval, list(val_idx))
    return train, val


@torch.no_grad()
def accuracy(model, loader, device):
    model.eval()
    correct = total = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    return 100.0 * correct / total


def run_trial(trial_id, hp, args, device):
    torch.manual_seed(hp.get("seed", 0))
    train, val = get_datasets(args.data, args.val_size, args.split_seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=3,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=1000, num_workers=2)

    model = resnet20().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=0.9, weight_decay=hp["wd"],
                          nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=hp["lr"], epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))
    crit = nn.CrossEntropyLoss(label_smoothing=hp["smoothing"])

    run = wandb.init(project=args.project, group=args.group, name=f"trial{trial_id:03d}",
                     config={**hp, "epochs": args.epochs, "batch_size": args.batch_size},
                     reinit=True)
    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = accuracy(model, val_loader, device)
        best = max(best, acc)
        run.log({"epoch": epoch, "val/acc": acc, "train/loss": loss.item()})
    run.summary["best_val_acc"] = best
    run.finish()

    result = {"trial": trial_id, "hp": hp, "best_val_acc": best, "final_val_acc": acc}
    with open(os.path.join(args.out, f"trial_{trial_id:03d}.json"), "w") as f:
        json.dump(result, f, indent=2)
    torch.save(model.state_dict(), os.path.join(args.out, f"trial_{trial_id:03d}.pt"))
    return result


def gpu_worker(gpu, n_gpus, trials, args):
    torch.cuda.set_device(gpu)
    device = torch.device("cuda", gpu)
    torch.backends.cudnn.benchmark = True
    for trial_id, hp in trials:
        if trial_id % n_gpus != gpu:
            continue
        if os.path.exists(os.path.join(args.out, f"trial_{trial_id:03d}.json")):
            continue  # finished in an earlier (interrupted) sweep
        t0 = time.time()
        res = run_trial(trial_id, hp, args, device)
        print(f"[gpu {gpu}] trial {trial_id} {hp} -> {res['best_val_acc']:.2f} "
              f"({(time.time() - t0) / 60:.1f} min)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", required=True)
    ap.add_argument("--data", default="./data")
    ap.add_argument("--out", default="sweeps/ls_grid")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--val-size", type=int, default=5000)
    ap.add_argument("--split-seed", type=int, default=0)
    ap.add_argument("--project", default="ls-grid")
    ap.add_argument("--group", default=None)
    ap.add_argument("--gpus", type=int, default=None)
    args = ap.parse_args()

    with open(args.grid) as f:
        grid = yaml.safe_load(f)
    trials = list(enumerate(expand_grid(grid)))
    os.makedirs(args.out, exist_ok=True)
    args.group = args.group or os.path.basename(args.out.rstrip("/"))

    # download once in the parent, before any worker starts
    torchvision.datasets.CIFAR10(args.data, train=True, download=True)

    n_gpus = args.gpus or torch.cuda.device_count()
    print(f"{len(trials)} trials on {n_gpus} GPUs")
    mp.spawn(gpu_worker, args=(n_gpus, trials, args), nprocs=n_gpus, join=True)

    results = []
    for trial_id, _ in trials:
        with open(os.path.join(args.out, f"trial_{trial_id:03d}.json")) as f:
            results.append(json.load(f))
    results.sort(key=lambda r: -r["best_val_acc"])
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(results, f, indent=2)
    for r in results[:5]:
        print(f"{r['best_val_acc']:.2f}  {r['hp']}")


if __name__ == "__main__":
    main()
