"""DANN with a ViT-B/16 backbone (timm) on Office-Home, bf16 autocast, DDP.

    torchrun --nproc_per_node=4 10_dann_vit_officehome.py --cfg-source Art --cfg-target Real_World
"""
import argparse
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import resolve_data_config
from timm.data.transforms_factory import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="/data/OfficeHome")
    p.add_argument("--cfg-source", default="Art")
    p.add_argument("--cfg-target", default="Real_World")
    p.add_argument("--model", default="vit_base_patch16_224.augreg_in21k_ft_in1k")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--backbone-lr-scale", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--iters-per-epoch", type=int, default=300)
    p.add_argument("--lambda-dom", type=float, default=0.1)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--output", default="work_dirs/dann_vit")
    return p


class FolderList(Dataset):
    """<root>/<domain>/<class>/<img>; classes are taken from the sorted folder names."""

    def __init__(self, root, domain, transform):
        droot = os.path.join(root, domain)
        self.classes = sorted(d for d in os.listdir(droot) if os.path.isdir(os.path.join(droot, d)))
        self.samples = []
        for ci, c in enumerate(self.classes):
            for fn in sorted(os.listdir(os.path.join(droot, c))):
                self.samples.append((os.path.join(droot, c, fn), ci))
        self.transform = transform

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, y = self.samples[i]
        return self.transform(Image.open(path).convert("RGB")), y


class GRL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, l):
        ctx.l = l
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.neg() * ctx.l, None


class ViTDANN(nn.Module):
    def __init__(self, name, num_classes):
        super().__init__()
        self.backbone = timm.create_model(name, pretrained=True, num_classes=0)
        d = self.backbone.num_features
        self.cls_head = nn.Sequential(nn.Linear(d, 512), nn.GELU(), nn.Dropout(0.1), nn.Linear(512, num_classes))
        self.dom_head = nn.Sequential(nn.Linear(d, 1024), nn.ReLU(), nn.Dropout(0.5),
                                      nn.Linear(1024, 1024), nn.ReLU(), nn.Dropout(0.5), nn.Linear(1024, 1))

    def forward(self, x, grl_lambda):
        z = self.backbone(x)
        return self.cls_head(z), self.dom_head(GRL.apply(z, grl_lambda))


def cycle(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, _ = model(x, 0.0)
        correct += (logits.argmax(1) == y).sum().item()
        total += y.numel()
    model.train()
    return 100.0 * correct / max(total, 1)


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    probe = timm.create_model(args.model, pretrained=False, num_classes=0)
    cfg = resolve_data_config({}, model=probe)
    del probe
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    test_tf = create_transform(**cfg, is_training=False)

    src = FolderList(args.data_dir, args.cfg_source, train_tf)
    tgt = FolderList(args.data_dir, args.cfg_target, train_tf)
    tgt_test = FolderList(args.data_dir, args.cfg_target, test_tf)
    assert src.classes == tgt.classes

    s_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    t_sampler = DistributedSampler(tgt, shuffle=True, drop_last=True)
    s_loader = DataLoader(src, args.batch_size, sampler=s_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    t_loader = DataLoader(tgt, args.batch_size, sampler=t_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    test_loader = DataLoader(tgt_test, 64, sampler=DistributedSampler(tgt_test, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    model = ViTDANN(args.model, len(src.classes)).to(device)
    groups = [
        {"params": model.backbone.parameters(), "lr": args.lr * args.backbone_lr_scale},
        {"params": list(model.cls_head.parameters()) + list(model.dom_head.parameters()), "lr": args.lr},
    ]
    optimizer = torch.optim.SGD(groups, momentum=0.9, weight_decay=5e-4)
    init_lrs = [g["lr"] for g in groups]
    model = DDP(model, device_ids=[local_rank])

    s_iter, t_iter = cycle(s_loader, s_sampler), cycle(t_loader, t_sampler)
    total_iters = args.epochs * args.iters_per_epoch
    history, best_acc, step = [], 0.0, 0
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)

    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for i in range(args.iters_per_epoch):
            p = step / total_iters
            for g, lr0 in zip(optimizer.param_groups, init_lrs):
                g["lr"] = lr0 / (1 + 10 * p) ** 0.75
            lam = 2.0 / (1 + math.exp(-10 * p)) - 1

            xs, ys = next(s_iter)
            xt, _ = next(t_iter)
            x = torch.cat([xs, xt]).to(device, non_blocking=True)
            ys = ys.to(device, non_blocking=True)
            dom_y = torch.cat([torch.zeros(len(xs)), torch.ones(len(xt))]).to(device).unsqueeze(1)

            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, dom = model(x, lam)
                loss_cls = F.cross_entropy(logits[: len(xs)], ys)
                loss_dom = F.binary_cross_entropy_with_logits(dom.float(), dom_y)
                loss = loss_cls + args.lambda_dom * loss_dom

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            step += 1

            if i % 50 == 0:
                l = torch.stack([loss_cls.detach().float(), loss_dom.detach().float()])
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"[ep {epoch} it {i}] cls {l[0]:.4f} dom {l[1]:.4f} lam {lam:.3f} "
                          f"{time.time() - t0:.0f}s", flush=True)

        acc = evaluate(model, test_loader, device)
        if rank == 0:
            history.append({"epoch": epoch, "target_acc": acc})
            print(f"epoch {epoch}: target acc {acc:.2f}", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                           os.path.join(args.output, "best.pth"))
            with open(os.path.join(args.output, "history.json"), "w") as f:
                json.dump(history, f, indent=1)
        dist.barrier()

    if rank == 0:
        print(f"best target acc: {best_acc:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
