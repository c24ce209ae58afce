"""FixMatch fine-tuning of an ImageNet-pretrained ResNet-50 on Semi-Aves (FGVC7 semi-supervised).

Labelled images come from l_train (list file: "path label"), the unlabelled pool from
u_train_in (+ optionally u_train_out, the out-of-class images).  The backbone is
trained with a 10x smaller learning rate than the freshly initialised classifier.

    torchrun --nproc_per_node=8 19_semi_aves_finetune.py --root /data/semi_aves --use-out-class
"""
import argparse
import math
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
NUM_CLASSES = 200


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/semi_aves")
    p.add_argument("--out", default="./runs/semi_aves_fixmatch")
    p.add_argument("--use-out-class", action="store_true")
    p.add_argument("--batch-size", type=int, default=8, help="labelled per GPU")
    p.add_argument("--mu", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.04, help="classifier lr for the global batch")
    p.add_argument("--backbone-lr-mult", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--iters", type=int, default=50000)
    p.add_argument("--eval-every", type=int, default=2500)
    p.add_argument("--threshold", type=float, default=0.8)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ListDataset(Dataset):
    def __init__(self, root, list_file, transform):
        self.root, self.transform = root, transform
        with open(list_file) as f:
            rows = [line.split() for line in f if line.strip()]
        self.items = [(r[0], int(r[1]) if len(r) > 1 else -1) for r in rows]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        return self.transform(img), y


class WeakStrong:
    def __init__(self):
        norm = [T.ToTensor(), T.Normalize(MEAN, STD)]
        self.weak = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1.0)), T.RandomHorizontalFlip()] + norm)
        self.strong = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                                 T.RandAugment(2, 9)] + norm)

    def __call__(self, img):
        return self.weak(img), self.strong(img)


def param_groups(model, lr, backbone_mult, wd):
    head = list(model.fc.parameters())
    head_ids = {id(p) for p in head}
    backbone = [p for p in model.parameters() if id(p) not in head_ids]
    return [{"params": backbone, "lr": lr * backbone_mult, "weight_decay": wd},
            {"params": head, "lr": lr, "weight_decay": wd}]


def infinite(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for b in loader:
            yield b
        ep += 1


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        top5 = net(x).topk(5, 1).indices
        s[0] += (top5[:, 0] == y).sum()
        s[1] += (top5 == y[:, None]).any(1).sum()
        s[2] += y.numel()
    dist.all_reduce(s)
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    lab_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                        T.ToTensor(), T.Normalize(MEAN, STD)])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    lab_set = ListDataset(args.root, os.path.join(args.root, "l_train.txt"), lab_tf)
    unl_lists = ["u_train_in.txt"] + (["u_train_out.txt"] if args.use_out_class else [])
    unl_set = torch.utils.data.ConcatDataset(
        [ListDataset(args.root, os.path.join(args.root, f), WeakStrong()) for f in unl_lists])
    val_set = ListDataset(args.root, os.path.join(args.root, "val.txt"), val_tf)

    lab_sampler = DistributedSampler(lab_set, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, drop_last=True)
    lab_loader = DataLoader(lab_set, args.batch_size, sampler=lab_sampler, num_workers=args.workers // 2,
                            pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, args.batch_size * args.mu, sampler=unl_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 128, num_workers=4)

    if rank == 0:
        torchvision.models.resnet50(weights="IMAGENET1K_V2")  # populate the torch hub cache once
    dist.barrier()
    net = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    net.fc = nn.Linear(net.fc.in_features, NUM_CLASSES)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    ema_net = deepcopy(net).eval()
    for p in ema_net.parameters():
        p.requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])

    optimizer = torch.optim.SGD(param_groups(model, args.lr, args.backbone_lr_mult, args.wd),
                                momentum=0.9, nesterov=True)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    lab_stream = infinite(lab_loader, lab_sampler)
    unl_stream = infinite(unl_loader, unl_sampler)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best, tic = 0.0, time.time()
    model.train()
    for it in range(1, args.iters + 1):
        factor = 0.5 * (1 + math.cos(math.pi * it / args.iters))
        for g, base in zip(optimizer.param_groups, base_lrs):
            g["lr"] = base * factor

        x, y = next(lab_stream)
        (u_w, u_s), _ = next(unl_stream)
        n = x.size(0)
        logits = model(torch.cat([x, u_w, u_s]).to(device, non_blocking=True))
        y = y.to(device, non_blocking=True)
        logits_x = logits[:n]
        logits_w, logits_s = logits[n:].chunk(2)
        loss_x = F.cross_entropy(logits_x, y)
        with torch.no_grad():
            conf, pseudo = logits_w.softmax(1).max(1)
            mask = (conf >= args.threshold).float()
        loss_u = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
        loss = loss_x + args.lambda_u * loss_u

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for pe, pm in zip(ema_net.parameters(), model.module.parameters()):
                pe.mul_(args.ema).add_(pm.detach(), alpha=1 - args.ema)
            for be, bm in zip(ema_net.buffers(), model.module.buffers()):
                be.copy_(bm)

        if rank == 0 and it % 50 == 0:
            print(f"it {it} loss_x {loss_x.item():.4f} loss_u {loss_u.item():.4f} mask {mask.mean().item():.3f} "
                  f"lr {optimizer.param_groups[1]['lr']:.5f} {(time.time() - tic) / 50:.2f}s/it", flush=True)
            tic = time.time()

        if it % args.eval_every == 0:
            top1, top5 = evaluate(ema_net, val_loader, device)
            if rank == 0:
                print(f"[val] it {it}: ema top1 {top1:.2f} top5 {top5:.2f}", flush=True)
                state = {"it": it, "model": model.module.state_dict(), "ema": ema_net.state_dict(),
                         "optimizer": optimizer.state_dict(), "top1": top1}
                torch.save(state, os.path.join(args.out, "last.pth"))
                if top1 > best:
                    best = top1
                    torch.save(ema_net.state_dict(), os.path.join(args.out, "best_ema.pth"))
            model.train()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
