"""Class-balanced self-training (CBST-style) for Office-31 A -> D with an EMA teacher.

Every round the teacher pseudo-labels the target set (each rank labels its own shard,
the shards are gathered), the most confident fraction of each class is kept, and the
student trains on source + selected target samples with gradient accumulation.

    torchrun --nproc_per_node=4 16_cbst_self_training_office.py --src amazon --tgt dslr --rounds 5 \
        --init /shared/runs/source_only_amazon/model.pth
"""
import argparse
import copy
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms
from torchvision.datasets import ImageFolder


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/shared/datasets/office31")
    p.add_argument("--src", default="amazon")
    p.add_argument("--tgt", default="dslr")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters-per-round", type=int, default=1500)
    p.add_argument("--init-portion", type=float, default=0.2)
    p.add_argument("--portion-step", type=float, default=0.15)
    p.add_argument("--max-portion", type=float, default=0.8)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--conf-floor", type=float, default=0.5, help="ignore selected samples below this confidence")
    p.add_argument("--out", default="/shared/runs/cbst_a2d")
    p.add_argument("--init", default="", help="source-only weights (state_dict of the bare network)")
    p.add_argument("--resume", default="")
    return p.parse_args()


class PseudoLabeled(Dataset):
    def __init__(self, folder, indices, labels):
        self.folder, self.indices, self.labels = folder, list(indices), list(labels)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        x, _ = self.folder[self.indices[i]]
        return x, self.labels[i]


def make_net(num_classes):
    net = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    net.fc = nn.Sequential(nn.Linear(2048, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, num_classes))
    return net


def forever(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        yield from loader
        ep += 1


@torch.no_grad()
def predict_shard(model, dataset, rank, world, device):
    """Predictions for this rank's strided shard; returns (global index, prob vector) pairs."""
    model.eval()
    shard = list(range(rank, len(dataset), world))
    loader = DataLoader(Subset(dataset, shard), batch_size=128, num_workers=4)
    probs = []
    for x, _ in loader:
        probs.append(model(x.to(device, non_blocking=True)).softmax(1).cpu())
    return shard, torch.cat(probs) if probs else torch.empty(0)


def class_balanced_select(probs, portion):
    conf, pred = probs.max(1)
    keep = torch.zeros_like(conf, dtype=torch.bool)
    for c in pred.unique():
        idx = (pred == c).nonzero(as_tuple=True)[0]
        k = max(1, int(round(portion * idx.numel())))
        top = conf[idx].topk(k).indices
        keep[idx[top]] = True
    return keep, pred, conf


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.6, 1.0)), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    test_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src = ImageFolder(os.path.join(args.root, args.src, "images"), train_tf)
    tgt_train = ImageFolder(os.path.join(args.root, args.tgt, "images"), train_tf)
    tgt_eval = ImageFolder(os.path.join(args.root, args.tgt, "images"), test_tf)
    num_classes = len(src.classes)
    src_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    src_stream = forever(DataLoader(src, args.bs, sampler=src_sampler, num_workers=4, drop_last=True,
                                    pin_memory=True), src_sampler)

    student = make_net(num_classes).to(device)
    if args.init:
        student.load_state_dict(torch.load(args.init, map_location=device))
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.SGD([{"params": [p for n, p in student.named_parameters() if not n.startswith("fc.")], "lr": 0.1 * args.lr},
                           {"params": student.fc.parameters(), "lr": args.lr}], momentum=0.9, weight_decay=5e-4)
    start_round = 0
    if args.resume:
        ck = torch.load(args.resume, map_location=device)
        student.load_state_dict(ck["student"])
        teacher.load_state_dict(ck["teacher"])
        opt.load_state_dict(ck["opt"])
        start_round = ck["round"] + 1
    student = DDP(student, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for rnd in range(start_round, args.rounds):
        # 1) pseudo-label the target domain with the teacher, then share the shards
        shard_idx, shard_probs = predict_shard(teacher, tgt_eval, rank, world, device)
        parts = [None] * world
        dist.all_gather_object(parts, (shard_idx, shard_probs))
        order = np.concatenate([np.asarray(i, dtype=np.int64) for i, _ in parts])
        probs = torch.cat([p for _, p in parts])[np.argsort(order)]
        portion = min(args.max_portion, args.init_portion + rnd * args.portion_step)
        keep, pseudo, conf = class_balanced_select(probs, portion)
        sel = keep.nonzero(as_tuple=True)[0].tolist()
        gt = torch.tensor(tgt_eval.targets)
        pl_acc = (pseudo[keep] == gt[keep]).float().mean().item()
        teacher_acc = (pseudo == gt).float().mean().item()
        if rank == 0:
            print(f"round {rnd}: teacher acc {teacher_acc:.4f}, kept {len(sel)}/{len(probs)} "
                  f"(portion {portion:.2f}), pseudo-label acc {pl_acc:.4f}", flush=True)

        pl_set = PseudoLabeled(tgt_train, sel, pseudo[keep].tolist())
        pl_conf = conf[keep]
        pl_sampler = DistributedSampler(pl_set, shuffle=True, drop_last=False)
        pl_stream = forever(DataLoader(pl_set, args.bs, sampler=pl_sampler, num_workers=4, pin_memory=True),
                            pl_sampler)

        # 2) train the student for a fixed number of optimiser steps
        student.train()
        teacher.train()
        for it in range(args.iters_per_round):
            opt.zero_grad(set_to_none=True)
            for micro in range(args.accum):
                xs, ys = next(src_stream)
                xt, yt = next(pl_stream)
                x = torch.cat([xs, xt]).to(device, non_blocking=True)
                ys, yt = ys.to(device, non_blocking=True), yt.to(device, non_blocking=True)
                sync = micro == args.accum - 1
                ctx = student.no_sync() if not sync else torch.enable_grad()
                with ctx:
                    logits = student(x)
                    ns = xs.size(0)
                    with torch.no_grad():
                        w = (logits[ns:].softmax(1).gather(1, yt[:, None]).squeeze(1) >= args.conf_floor).float()
                    loss_s = F.cross_entropy(logits[:ns], ys)
                    loss_t = (F.cross_entropy(logits[ns:], yt, reduction="none") * w).mean()
                    ((loss_s + loss_t) / args.accum).backward()
            opt.step()
            with torch.no_grad():
                for tp, sp in zip(teacher.parameters(), student.module.parameters()):
                    tp.lerp_(sp, 1.0 - args.ema)
                for tb, sb in zip(teacher.buffers(), student.module.buffers()):
                    tb.copy_(sb)
            if rank == 0 and it % 100 == 0:
                print(f"  r{rnd} it {it} src {loss_s.item():.3f} tgt {loss_t.item():.3f} "
                      f"w {w.mean().item():.2f} mean-conf {pl_conf.mean().item():.3f}", flush=True)

        if rank == 0:
            torch.save({"round": rnd, "student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "opt": opt.state_dict()}, os.path.join(args.out, f"round{rnd}.pth"))
        dist.barrier()

    # final target accuracy of the teacher, same gather as above
    shard_idx, shard_probs = predict_shard(teacher, tgt_eval, rank, world, device)
    parts = [None] * world
    dist.all_gather_object(parts, (shard_idx, shard_probs))
    if rank == 0:
        order = np.concatenate([np.asarray(i, dtype=np.int64) for i, _ in parts])
        probs = torch.cat([p for _, p in parts])[np.argsort(order)]
        acc = (probs.argmax(1) == torch.tensor(tgt_eval.targets)).float().mean().item()
        print(f"final teacher acc on {args.tgt}: {acc:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
