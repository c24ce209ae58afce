"""Activation-based channel pruning of VGG-16-BN (CIFAR-10), then fine-tuning of the slim net.

1. load the dense baseline,
2. run calibration batches and score every conv channel by its mean post-ReLU activation,
3. drop channels whose score is below --keep-thresh x (layer mean score),
4. rebuild a thinner VGG with the surviving channels and fine-tune it with DDP.

    torchrun --nproc_per_node=4 07_structured_prune_vgg.py --baseline ckpt/vgg16bn_c10.pt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]


class VGG(nn.Module):
    def __init__(self, cfg, num_classes=10):
        super().__init__()
        self.cfg = list(cfg)
        layers, c_in = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c_in, v, 3, padding=1, bias=False), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c_in = v
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def args_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar10")
    p.add_argument("--baseline", required=True)
    p.add_argument("--out", default="ckpt/vgg16bn_c10_pruned.pt")
    p.add_argument("--calib-batches", type=int, default=40)
    p.add_argument("--keep-thresh", type=float, default=0.35)
    p.add_argument("--min-channels", type=int, default=16)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--wd", type=float, default=5e-4)
    return p.parse_args()


@torch.no_grad()
def channel_scores(model, loader, device, n_batches):
    """Mean post-ReLU activation of every channel, one tensor per conv layer."""
    relus = [m for m in model.features if isinstance(m, nn.ReLU)]
    sums = [None] * len(relus)
    count = 0
    hooks = []
    for idx, relu in enumerate(relus):
        def hook(_m, _inp, out, idx=idx):
            s = out.mean(dim=(0, 2, 3))
            sums[idx] = s if sums[idx] is None else sums[idx] + s
        hooks.append(relu.register_forward_hook(hook))
    model.eval()
    for i, (x, _) in enumerate(loader):
        if i >= n_batches:
            break
        model(x.to(device, non_blocking=True))
        count += 1
    for h in hooks:
        h.remove()
    return [s / count for s in sums]


def select_channels(scores, keep_thresh, min_channels):
    keep = []
    for s in scores:
        idx = torch.nonzero(s >= keep_thresh * s.mean()).flatten()
        if idx.numel() < min_channels:
            idx = torch.topk(s, min_channels).indices.sort().values
        keep.append(idx)
    return keep


@torch.no_grad()
def build_pruned(dense, keep):
    new_cfg, k = [], 0
    for v in dense.cfg:
        if v == "M":
            new_cfg.append("M")
        else:
            new_cfg.append(int(keep[k].numel()))
            k += 1
    slim = VGG(new_cfg, num_classes=dense.classifier.out_features)
    d_convs = [m for m in dense.features if isinstance(m, nn.Conv2d)]
    d_bns = [m for m in dense.features if isinstance(m, nn.BatchNorm2d)]
    s_convs = [m for m in slim.features if isinstance(m, nn.Conv2d)]
    s_bns = [m for m in slim.features if isinstance(m, nn.BatchNorm2d)]
    prev = torch.arange(3, device=keep[0].device)
    for dc, db, sc, sb, idx in zip(d_convs, d_bns, s_convs, s_bns, keep):
        sc.weight.copy_(dc.weight[idx][:, prev])
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(sb, name).copy_(getattr(db, name)[idx])
        prev = idx
    slim.classifier.weight.copy_(dense.classifier.weight[:, prev])
    slim.classifier.bias.copy_(dense.classifier.bias)
    return slim


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        c[0] += (model(x).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (100 * c[0] / c[1]).item()


def count_params(m):
    return sum(p.numel() for p in m.parameters())


def main():
    args = args_parser()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(mean, std)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    train_set = torchvision.datasets.CIFAR10(args.data, train=True, transform=train_tf)
    calib_set = torchvision.datasets.CIFAR10(args.data, train=True, transform=test_tf)
    test_set = torchvision.datasets.CIFAR10(args.data, train=False, transform=test_tf)

    train_sampler = DistributedSampler(train_set, shuffle=True)
    calib_sampler = DistributedSampler(calib_set, shuffle=True, seed=1)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    calib_loader = DataLoader(calib_set, 256, sampler=calib_sampler, num_workers=6, pin_memory=True)
    test_loader = DataLoader(test_set, 500, sampler=test_sampler, num_workers=6, pin_memory=True)

    # ---- dense baseline
    dense = VGG(VGG16_CFG).to(device)
    dense.load_state_dict(torch.load(args.baseline, map_location="cpu"))
    base_acc = evaluate(dense, test_loader, device)

    # ---- score channels on calibration data and cut
    scores = channel_scores(dense, calib_loader, device, args.calib_batches)
    keep = select_channels(scores, args.keep_thresh, args.min_channels)
    model = build_pruned(dense, keep).to(device)
    del dense
    pruned_acc = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"dense {base_acc:.2f}% -> pruned (no ft) {pruned_acc:.2f}%  cfg={model.cfg}")
        print(f"params: {count_params(model) / 1e6:.2f}M")

    cfg = model.cfg
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9, weight_decay=args.wd, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()
        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"ft epoch {epoch}: loss {loss.item():.3f} acc {acc:.2f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save({"cfg": cfg, "state_dict": model.module.state_dict(), "acc": acc}, args.out)

    if rank == 0:
        print(f"best fine-tuned accuracy {best:.2f}% (dense {base_acc:.2f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
