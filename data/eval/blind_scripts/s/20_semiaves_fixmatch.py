"""
Semi-Aves (FGVC8) - FixMatch-style online pseudo-labels on the unlabeled pool.
Weak view -> confident argmax becomes the target for the strong view.

    torchrun --nproc_per_node=4 20_semiaves_fixmatch.py --epochs 60 --wandb
"""
import os
import time
import math
import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import torchvision.transforms as T
from PIL import Image
import timm
from timm.utils import ModelEmaV2

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/semi-aves")
    ap.add_argument("--arch", default="resnet50.a1_in1k")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=32, help="labeled batch per gpu")
    ap.add_argument("--mu", type=int, default=5, help="unlabeled/labeled ratio")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--tau", type=float, default=0.95)
    ap.add_argument("--lambda_u", type=float, default=1.0)
    ap.add_argument("--out", default="./fixmatch_aves")
    ap.add_argument("--wandb", action="store_true")
    return ap.parse_args()


weak_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.5, 1.0)), T.RandomHorizontalFlip()])
strong_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.3, 1.0)), T.RandomHorizontalFlip(),
                       T.RandAugment(num_ops=2, magnitude=10)])
to_tensor = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
test_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])


class Labeled(Dataset):
    def __init__(self, df, root, tf):
        self.paths = [os.path.join(root, p) for p in df.path]
        self.y = df.label.values
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), int(self.y[i]), i


class Unlabeled(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return to_tensor(weak_tf(img)), to_tensor(strong_tf(img))


def cycle(loader, sampler):
    ep = 0
    while True:
        sampler.set_epoch(ep)
        for b in loader:
            yield b
        ep += 1


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    wb = None
    if args.wandb and rank == 0:
        import wandb
        wb = wandb.init(project="semi-aves", config=vars(args))

    lab = pd.read_csv(f"{args.root}/l_train.csv")
    val = pd.read_csv(f"{args.root}/val.csv")
    u_paths = sorted(os.path.join(args.root, "u_train", f)
                     for f in os.listdir(f"{args.root}/u_train"))
    n_cls = int(lab.label.max()) + 1

    ds_l = Labeled(lab, args.root, T.Compose([weak_tf, to_tensor]))
    ds_u = Unlabeled(u_paths)
    ds_v = Labeled(val, args.root, test_tf)
    s_l = DistributedSampler(ds_l, shuffle=True, drop_last=True)
    s_u = DistributedSampler(ds_u, shuffle=True, drop_last=True)
    s_v = DistributedSampler(ds_v, shuffle=False)
    dl_l = DataLoader(ds_l, args.bs, sampler=s_l, num_workers=4, drop_last=True, pin_memory=True)
    dl_u = DataLoader(ds_u, args.bs * args.mu, sampler=s_u, num_workers=12, drop_last=True,
                      pin_memory=True)
    dl_v = DataLoader(ds_v, 128, sampler=s_v, num_workers=4)

    net = timm.create_model(args.arch, pretrained=True, num_classes=n_cls).to(dev)
    ema = ModelEmaV2(net, decay=0.999)
    model = DDP(net, device_ids=[local_rank])

    no_decay = [p for n, p in net.named_parameters() if "bn" in n or n.endswith(".bias")]
    decay = [p for n, p in net.named_parameters() if not ("bn" in n or n.endswith(".bias"))]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    iters = 1024  # fixed iterations per "epoch", as in FixMatch
    total = args.epochs * iters
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: math.cos(7 * math.pi * s / (16 * total)))
    scaler = torch.cuda.amp.GradScaler()

    it_l, it_u = cycle(dl_l, s_l), cycle(dl_u, s_u)
    best = 0.0
    for ep in range(args.epochs):
        model.train()
        t0 = time.time()
        stats = torch.zeros(4, device=dev)
        for _ in range(iters):
            xl, yl, _ = next(it_l)
            xw, xs = next(it_u)
            xl, yl = xl.to(dev, non_blocking=True), yl.to(dev, non_blocking=True)
            xw, xs = xw.to(dev, non_blocking=True), xs.to(dev, non_blocking=True)
            with torch.cuda.amp.autocast():
                with torch.no_grad():
                    pw = model(xw).float().softmax(1)
                conf, pl = pw.max(1)
                mask = (conf >= args.tau).float()
                logits_l = model(xl)
                logits_s = model(xs)
                loss_x = F.cross_entropy(logits_l, yl)
                loss_u = (F.cross_entropy(logits_s, pl, reduction="none") * mask).mean()
                loss = loss_x + args.lambda_u * loss_u
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            ema.update(net)
            stats += torch.stack([loss_x.detach().float(), loss_u.detach().float(), mask.mean(),
                                  torch.ones((), device=dev)])
        dist.all_reduce(stats)

        e = ema.module
        e.eval()
        correct = torch.zeros(len(ds_v), device=dev)
        seen = torch.zeros(len(ds_v), device=dev)
        with torch.no_grad():
            for x, y, i in dl_v:
                x, y, i = x.to(dev), y.to(dev), i.to(dev)
                with torch.cuda.amp.autocast():
                    correct[i] = (e(x).argmax(1) == y).float()
                seen[i] = 1
        dist.all_reduce(correct, op=dist.ReduceOp.MAX)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        acc = (correct.sum() / seen.sum()).item()

        if rank == 0:
            lx, lu, mk = (stats[:3] / stats[3]).tolist()
            print(f"ep {ep} Lx {lx:.3f} Lu {lu:.3f} mask {mk:.3f} top1 {acc:.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
            if wb:
                wb.log({"loss_x": lx, "loss_u": lu, "mask_rate": mk, "top1": acc, "epoch": ep})
            if acc > best:
                best = acc
                os.makedirs(args.out, exist_ok=True)
                torch.save(e.state_dict(), f"{args.out}/{args.arch}_ema_best.pth")
        dist.barrier()

    if wb:
        wb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
