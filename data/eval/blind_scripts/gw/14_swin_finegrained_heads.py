"""Fine-grained multi-dataset training: Swin-T trunk shared by several
fine-grained datasets, one linear head per dataset.

The task list comes from the YAML config and can be extended from the command
line. Every step takes an equal-size batch from every task (task-balanced), so
small datasets are revisited more often than large ones.

    torchrun --nproc_per_node=8 finegrained_mtl.py -c configs/fg.yaml --extra_tasks inat_insecta
"""
import argparse
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from timm.data import create_transform, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision.datasets import ImageFolder

log = logging.getLogger("fg_mtl")


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--extra_tasks", nargs="*", default=[])
    ap.add_argument("--output", default="output/fg_mtl")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("arch", "swin_tiny_patch4_window7_224.ms_in22k")
    cfg.setdefault("batch_per_task", 24)
    cfg.setdefault("lr", 2e-4)
    cfg.setdefault("min_lr", 1e-6)
    cfg.setdefault("epochs", 50)
    cfg.setdefault("iters_per_epoch", 800)
    cfg.setdefault("warmup_epochs", 3)
    cfg.setdefault("data_root", "/datasets/finegrained")
    return cfg, args


class SharedTrunk(nn.Module):
    def __init__(self, arch, num_classes):
        super().__init__()
        self.trunk = timm.create_model(arch, pretrained=True, num_classes=0, drop_path_rate=0.2)
        dim = self.trunk.num_features
        self.heads = nn.ModuleDict()
        for t, n in num_classes.items():
            self.heads[t] = nn.Linear(dim, n)

    def forward(self, x, sizes):
        feats = self.trunk(x).split(sizes)
        return {t: self.heads[t](f) for t, f in zip(self.heads, feats)}


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def validate(net, val_sets, device, rank, world):
    net.eval()
    stats = torch.zeros(len(val_sets), 3, device=device)  # top1, top5, n
    for i, (t, ds) in enumerate(val_sets.items()):
        loader = DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=128, num_workers=6, pin_memory=True)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net.heads[t](net.trunk(x))
            top5 = logits.topk(min(5, logits.size(1)), -1).indices
            stats[i, 0] += (top5[:, 0] == y).sum()
            stats[i, 1] += (top5 == y[:, None]).any(-1).sum()
            stats[i, 2] += len(y)
    dist.all_reduce(stats)
    net.train()
    return {t: (stats[i, 0] / stats[i, 2]).item() for i, t in enumerate(val_sets)}, \
           {t: (stats[i, 1] / stats[i, 2]).item() for i, t in enumerate(val_sets)}


def main():
    cfg, args = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(cfg.get("seed", 0))

    # config tasks plus any extra ones given on the command line, without duplicates
    tasks = list(set(cfg["tasks"]) | set(args.extra_tasks))
    log.info("tasks: %s", tasks)

    probe = timm.create_model(cfg["arch"], pretrained=False, num_classes=0)
    data_cfg = resolve_data_config({}, model=probe)
    del probe
    tf_train = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    tf_val = create_transform(**data_cfg, is_training=False)

    train_sets = {t: ImageFolder(os.path.join(cfg["data_root"], t, "train"), tf_train) for t in tasks}
    val_sets = {t: ImageFolder(os.path.join(cfg["data_root"], t, "val"), tf_val) for t in tasks}
    streams = {}
    for t, ds in train_sets.items():
        s = DistributedSampler(ds, shuffle=True, drop_last=True)
        dl = DataLoader(ds, batch_size=cfg["batch_per_task"], sampler=s, num_workers=4, pin_memory=True,
                        drop_last=True, persistent_workers=True)
        streams[t] = infinite(dl, s)

    net = SharedTrunk(cfg["arch"], {t: len(train_sets[t].classes) for t in tasks}).to(device)
    model = DDP(net, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    iters = cfg["epochs"] * cfg["iters_per_epoch"]
    warm = cfg["warmup_epochs"] * cfg["iters_per_epoch"]
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters - warm, eta_min=cfg["min_lr"]),
    ], milestones=[warm])
    criterion = LabelSmoothingCrossEntropy(smoothing=0.1)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        t0 = time.time()
        meter = torch.zeros(len(tasks), device=device)
        for it in range(cfg["iters_per_epoch"]):
            xs, ys = [], []
            for t in net.heads:
                x, y = next(streams[t])
                xs.append(x)
                ys.append(y)
            x = torch.cat(xs).to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x, [len(b) for b in xs])
            losses = torch.stack([criterion(out[t].float(), y.to(device, non_blocking=True))
                                  for t, y in zip(net.heads, ys)])
            loss = losses.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            meter += losses.detach()

        dist.all_reduce(meter, op=dist.ReduceOp.AVG)
        top1, top5 = validate(net, val_sets, device, rank, world)
        mean1 = sum(top1.values()) / len(top1)
        log.info("epoch %d (%.0fs) train %s | top1 %s | mean %.4f", epoch, time.time() - t0,
                 {t: round(v / cfg["iters_per_epoch"], 4) for t, v in zip(net.heads, meter.tolist())},
                 {t: round(v, 4) for t, v in top1.items()}, mean1)
        if rank == 0:
            os.makedirs(args.output, exist_ok=True)
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "tasks": list(net.heads)}
            torch.save(state, os.path.join(args.output, "last.pth"))
            if mean1 > best:
                best = mean1
                torch.save(state, os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
