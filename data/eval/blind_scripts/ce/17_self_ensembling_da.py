"""Self-ensembling for visual domain adaptation (French et al., 2018), Office-Home Real_World -> Product.

Student learns the source labels; on the target it is pulled towards an EMA teacher on a
differently augmented view, only where the teacher is confident.

    torchrun --nproc_per_node=4 17_self_ensembling_da.py --src Real_World --tgt Product
"""
import argparse
import os
import random

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


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/office_home")
    ap.add_argument("--src", default="Real_World")
    ap.add_argument("--tgt", default="Product")
    ap.add_argument("--val-frac", type=float, default=0.1, help="held-out labelled target images for model selection")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--iters", type=int, default=300, help="iterations per epoch")
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--teacher-alpha", type=float, default=0.99)
    ap.add_argument("--conf-thresh", type=float, default=0.9)
    ap.add_argument("--unsup-weight", type=float, default=3.0)
    ap.add_argument("--cls-balance", type=float, default=0.005)
    ap.add_argument("--seed", type=int, default=-1, help="-1: draw one and share it")
    ap.add_argument("--out", default="runs/selfens")
    return ap.parse_args()


def init_distributed():
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def shared_seed(seed):
    # every rank must agree on the seed: it decides the target train/val split
    t = torch.tensor([seed if seed >= 0 else random.randint(0, 2 ** 31 - 1)], dtype=torch.long, device="cuda")
    dist.broadcast(t, src=0)
    return int(t.item())


class Augmented(Dataset):
    def __init__(self, base, idx, tf, pair=False):
        self.base, self.idx, self.tf, self.pair = base, idx, tf, pair

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        path, y = self.base.samples[self.idx[i]]
        img = self.base.loader(path)
        if self.pair:
            return self.tf(img), self.tf(img)
        return self.tf(img), y


def network(num_classes):
    net = models.resnet50(weights=models.ResNet50_Weights.IMAGENET1K_V2)
    net.fc = nn.Sequential(nn.Dropout(0.3), nn.Linear(2048, num_classes))
    return net


def robust_binary_crossentropy(pred, tgt):
    inv_tgt = -tgt + 1.0
    inv_pred = -pred + 1.0 + 1e-6
    return -(tgt * torch.log(pred + 1e-6) + inv_tgt * torch.log(inv_pred))


def main():
    args = parse_args()
    rank, world, local_rank = init_distributed()
    seed = shared_seed(args.seed)
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(seed)
    np.random.seed(seed)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    aug = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(),
                              transforms.ColorJitter(0.2, 0.2, 0.2), transforms.ToTensor(), norm])
    plain = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm])
    src_folder = ImageFolder(os.path.join(args.root, args.src))
    tgt_folder = ImageFolder(os.path.join(args.root, args.tgt))
    perm = np.random.permutation(len(tgt_folder))
    n_val = int(args.val_frac * len(perm))
    val_idx, tgt_idx = perm[:n_val], perm[n_val:]

    src_set = Augmented(src_folder, np.arange(len(src_folder)), aug)
    tgt_set = Augmented(tgt_folder, tgt_idx, aug, pair=True)
    val_set = Augmented(tgt_folder, val_idx, plain)
    src_sampler = DistributedSampler(src_set, shuffle=True, seed=seed, drop_last=True)
    tgt_sampler = DistributedSampler(tgt_set, shuffle=True, seed=seed, drop_last=True)
    src_loader = DataLoader(src_set, args.bs, sampler=src_sampler, num_workers=6, pin_memory=True, drop_last=True)
    tgt_loader = DataLoader(tgt_set, args.bs, sampler=tgt_sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), 64, num_workers=4)

    student = network(len(src_folder.classes)).to(device)
    teacher = network(len(src_folder.classes)).to(device)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)
    student = DDP(student, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def streams():
        ep = 0
        while True:
            src_sampler.set_epoch(ep)
            tgt_sampler.set_epoch(ep)
            for a, b in zip(src_loader, tgt_loader):
                yield a, b
            ep += 1

    batches = streams()
    best = 0.0
    for epoch in range(args.epochs):
        student.train()
        teacher.train()
        for it in range(args.iters):
            (xs, ys), (xt_s, xt_t) = next(batches)
            xs, ys = xs.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            xt_s, xt_t = xt_s.to(device, non_blocking=True), xt_t.to(device, non_blocking=True)

            logits = student(torch.cat([xs, xt_s]))
            ns = xs.size(0)
            cls_loss = F.cross_entropy(logits[:ns], ys)
            p_student = logits[ns:].softmax(1)
            with torch.no_grad():
                p_teacher = teacher(xt_t).softmax(1)
                conf_mask = (p_teacher.max(1).values > args.conf_thresh).float()
            cons = ((p_student - p_teacher) ** 2).sum(1)
            unsup = (cons * conf_mask).mean()
            avg_p = p_student.mean(0)
            balance = robust_binary_crossentropy(avg_p, torch.full_like(avg_p, 1.0 / avg_p.numel())).sum()
            loss = cls_loss + args.unsup_weight * unsup + args.cls_balance * balance * conf_mask.mean()

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for tp, sp in zip(teacher.parameters(), student.module.parameters()):
                    tp.mul_(args.teacher_alpha).add_(sp, alpha=1 - args.teacher_alpha)
                for tb, sb in zip(teacher.buffers(), student.module.buffers()):
                    tb.copy_(sb)
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it} cls {cls_loss.item():.3f} unsup {unsup.item():.4f} "
                      f"mask {conf_mask.mean().item():.2f}", flush=True)

        teacher.eval()
        c = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                c[0] += (teacher(x.to(device)).argmax(1) == y.to(device)).sum()
                c[1] += y.numel()
        dist.all_reduce(c)
        acc = (c[0] / c[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: teacher target-val acc {acc:.4f}", flush=True)
            if acc > best:
                best = acc
                torch.save({"epoch": epoch, "teacher": teacher.state_dict(), "student": student.module.state_dict(),
                            "seed": seed}, os.path.join(args.out, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
