"""FixMatch on SVHN (1000 labels), WRN-28-2, AMP, interleaved batches.

    torchrun --nproc_per_node=4 07_fixmatch_svhn_interleave.py --out /shared/exp/fm_svhn_1000
    torchrun --nproc_per_node=4 07_fixmatch_svhn_interleave.py --out /shared/exp/fm_svhn_1000 --resume /shared/exp/fm_svhn_1000/checkpoint.pth.tar
"""
import argparse
import copy
import math
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/datasets/svhn")
    p.add_argument("--out", default="/shared/exp/fm_svhn")
    p.add_argument("--resume", default="")
    p.add_argument("--num-labeled", type=int, default=1000)
    p.add_argument("--total-steps", type=int, default=2 ** 20)
    p.add_argument("--eval-step", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16, help="labelled images per GPU")
    p.add_argument("--mu", type=int, default=7)
    p.add_argument("--base-lr", type=float, default=0.03, help="lr for a global labelled batch of 64")
    p.add_argument("--wdecay", type=float, default=5e-4)
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=1)
    return p


def interleave(x, size):
    s = list(x.shape)
    return x.reshape([-1, size] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def de_interleave(x, size):
    s = list(x.shape)
    return x.reshape([size, -1] + s[1:]).transpose(0, 1).reshape([-1] + s[1:])


def make_wrn(num_classes=10):
    def block(cin, cout, stride):
        return nn.Sequential(nn.BatchNorm2d(cin, momentum=0.001), nn.LeakyReLU(0.1, inplace=True),
                             nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                             nn.BatchNorm2d(cout, momentum=0.001), nn.LeakyReLU(0.1, inplace=True),
                             nn.Conv2d(cout, cout, 3, 1, 1, bias=False))

    class Res(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.body = block(cin, cout, stride)
            self.skip = nn.Identity() if cin == cout and stride == 1 else nn.Conv2d(cin, cout, 1, stride, bias=False)

        def forward(self, x):
            return self.body(x) + self.skip(x)

    w = [16, 32, 64, 128]
    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False)]
    for g, s in enumerate([1, 2, 2]):
        layers += [Res(w[g], w[g + 1], s)] + [Res(w[g + 1], w[g + 1], 1) for _ in range(3)]
    layers += [nn.BatchNorm2d(128, momentum=0.001), nn.LeakyReLU(0.1, inplace=True),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes)]
    return nn.Sequential(*layers)


class WeakStrong(Dataset):
    def __init__(self, ds, weak, strong):
        self.ds, self.weak, self.strong = ds, weak, strong

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, _ = self.ds[i]
        return self.weak(img), self.strong(img)


class EMA:
    def __init__(self, model, decay):
        self.model = copy.deepcopy(model)
        self.model.eval()
        self.decay = decay
        self.param_keys = [k for k, _ in self.model.named_parameters()]
        self.buffer_keys = [k for k, _ in self.model.named_buffers()]
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def step(self, model):
        msd, esd = model.state_dict(), self.model.state_dict()
        for k in self.param_keys:
            esd[k].mul_(self.decay).add_(msd[k].detach(), alpha=1.0 - self.decay)
        for k in self.buffer_keys:
            esd[k].copy_(msd[k])


def main():
    args = build_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    main_proc = rank == 0
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    mean, std = (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)
    to_t = [transforms.ToTensor(), transforms.Normalize(mean, std)]
    weak = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect")] + to_t)
    strong = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"),
                                 transforms.RandAugment(2, 10)] + to_t
                                + [transforms.RandomErasing(1.0, scale=(0.02, 0.1), value=0.5)])

    train = datasets.SVHN(args.data, split="train")
    labels = np.asarray(train.labels)
    # fixed seed -> every rank draws the identical labelled subset
    picked = np.concatenate([np.random.RandomState(args.seed).choice(np.where(labels == c)[0],
                             args.num_labeled // 10, replace=False) for c in range(10)])
    lab_ds = Subset(datasets.SVHN(args.data, split="train", transform=weak),
                    np.tile(picked, math.ceil(args.eval_step * args.batch_size * world / len(picked))))
    unl_ds = WeakStrong(train, weak, strong)
    test_ds = datasets.SVHN(args.data, split="test", transform=transforms.Compose(to_t))

    lab_sampler = DistributedSampler(lab_ds, shuffle=True, seed=args.seed, drop_last=True)
    unl_sampler = DistributedSampler(unl_ds, shuffle=True, seed=args.seed, drop_last=True)
    lab_loader = DataLoader(lab_ds, args.batch_size, sampler=lab_sampler, num_workers=4, drop_last=True, pin_memory=True)
    unl_loader = DataLoader(unl_ds, args.batch_size * args.mu, sampler=unl_sampler, num_workers=4,
                            drop_last=True, pin_memory=True)
    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), 512, num_workers=4)

    model = make_wrn(10).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ema = EMA(model, args.ema_decay)
    lr = args.base_lr * args.batch_size * world / 64
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.wdecay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: max(0.0, math.cos(7.0 * math.pi * s / (16.0 * args.total_steps))))
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best_acc = 0, 0.0
    if args.resume and os.path.isfile(args.resume):
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        ema.model.load_state_dict(ckpt["ema_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_acc = ckpt["epoch"], ckpt["best_acc"]
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    if main_proc:
        os.makedirs(args.out, exist_ok=True)
    epochs = math.ceil(args.total_steps / args.eval_step)
    lab_ep = unl_ep = start_epoch
    lab_sampler.set_epoch(lab_ep)
    unl_sampler.set_epoch(unl_ep)
    lab_it, unl_it = iter(lab_loader), iter(unl_loader)

    for epoch in range(start_epoch, epochs):
        model.train()
        mask_sum = torch.zeros((), device=device)
        for step in range(args.eval_step):
            try:
                x, y = next(lab_it)
            except StopIteration:
                lab_ep += 1
                lab_sampler.set_epoch(lab_ep)
                lab_it = iter(lab_loader)
                x, y = next(lab_it)
            try:
                uw, us = next(unl_it)
            except StopIteration:
                unl_ep += 1
                unl_sampler.set_epoch(unl_ep)
                unl_it = iter(unl_loader)
                uw, us = next(unl_it)

            bs = x.shape[0]
            inputs = interleave(torch.cat([x, uw, us]), 2 * args.mu + 1).to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = de_interleave(model(inputs), 2 * args.mu + 1)
            logits = logits.float()
            logits_x = logits[:bs]
            logits_u_w, logits_u_s = logits[bs:].chunk(2)
            del logits

            Lx = F.cross_entropy(logits_x, y)
            pseudo = torch.softmax(logits_u_w.detach() / args.T, dim=-1)
            max_p, targets_u = pseudo.max(dim=-1)
            mask = max_p.ge(args.threshold).float()
            Lu = (F.cross_entropy(logits_u_s, targets_u, reduction="none") * mask).mean()
            loss = Lx + args.lambda_u * Lu

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            ema.step(model.module)
            mask_sum += mask.mean()

        ema.model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for xt, yt in test_loader:
                xt, yt = xt.to(device, non_blocking=True), yt.to(device, non_blocking=True)
                counts[0] += (ema.model(xt).argmax(1) == yt).sum()
                counts[1] += yt.numel()
        dist.all_reduce(counts)
        dist.all_reduce(mask_sum)
        acc = (100.0 * counts[0] / counts[1]).item()
        mask_rate = mask_sum.item() / (world * args.eval_step)
        is_best = acc > best_acc
        best_acc = max(acc, best_acc)

        if main_proc:
            print(f"epoch {epoch + 1}/{epochs} lr {scheduler.get_last_lr()[0]:.4f} mask {mask_rate:.3f} "
                  f"test {acc:.2f} best {best_acc:.2f}", flush=True)
            path = os.path.join(args.out, "checkpoint.pth.tar")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "ema_state_dict": ema.model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "best_acc": best_acc}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.out, "model_best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
