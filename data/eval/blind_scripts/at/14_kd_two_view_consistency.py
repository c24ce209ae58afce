"""
Two-view distillation for a compact CNN (ResNet-18) from an EfficientNet-B3
teacher on Food-101. The student sees the weakly augmented image (supervised
CE) and a strongly augmented copy (RandAugment + CutMix) on which it must match
the teacher's predictions; both losses are summed into a single backward.

    torchrun --nproc_per_node=4 two_view_kd.py --root /data/food-101 \
        --teacher ckpt/effb3_food101.pth
"""
import argparse
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", default="resnet18")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--bs", type=int, default=96)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--T", type=float, default=2.0)
    ap.add_argument("--w-kd", type=float, default=1.0)
    ap.add_argument("--cutmix-p", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="/shared/kd/food101_r18")
    return ap.parse_args()


class Food101TwoView(Dataset):
    def __init__(self, root, split, weak, strong=None):
        with open(os.path.join(root, "meta", f"{split}.txt")) as f:
            rels = [l.strip() for l in f if l.strip()]
        classes = sorted({r.split("/")[0] for r in rels})
        self.cls_idx = {c: i for i, c in enumerate(classes)}
        self.items = [(os.path.join(root, "images", r + ".jpg"), self.cls_idx[r.split("/")[0]]) for r in rels]
        self.weak, self.strong = weak, strong

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        img = Image.open(path).convert("RGB")
        if self.strong is None:
            return self.weak(img), y
        return self.weak(img), self.strong(img), y


def cutmix(x, p, alpha=1.0):
    if np.random.rand() > p:
        return x
    lam = np.random.beta(alpha, alpha)
    idx = torch.randperm(x.size(0), device=x.device)
    H, W = x.shape[-2:]
    rh, rw = int(H * np.sqrt(1 - lam)), int(W * np.sqrt(1 - lam))
    cy, cx = np.random.randint(H), np.random.randint(W)
    y1, y2 = np.clip(cy - rh // 2, 0, H), np.clip(cy + rh // 2, 0, H)
    x1, x2 = np.clip(cx - rw // 2, 0, W), np.clip(cx + rw // 2, 0, W)
    x = x.clone()
    x[:, :, y1:y2, x1:x2] = x[idx, :, y1:y2, x1:x2]
    return x


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    r = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        r[0] += (model(x).argmax(1) == y).sum()
        r[1] += y.numel()
    dist.all_reduce(r)
    return (100 * r[0] / r[1]).item()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    np.random.seed(1000 + rank)

    weak = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1)), T.RandomHorizontalFlip(),
                      T.ToTensor(), T.Normalize(MEAN, STD)])
    strong = T.Compose([T.RandomResizedCrop(224, scale=(0.08, 1)), T.RandomHorizontalFlip(),
                        T.RandAugment(num_ops=2, magnitude=10), T.ToTensor(), T.Normalize(MEAN, STD),
                        T.RandomErasing(p=0.25)])
    test_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    train_ds = Food101TwoView(args.root, "train", weak, strong)
    test_ds = Food101TwoView(args.root, "test", test_tf)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_ds, 200, sampler=DistributedSampler(test_ds, shuffle=False),
                             num_workers=args.workers, pin_memory=True)

    teacher = timm.create_model("efficientnet_b3", num_classes=101)
    teacher.load_state_dict(torch.load(args.teacher, map_location="cpu"))
    teacher.to(device).eval().requires_grad_(False)

    student = timm.create_model(args.student, pretrained=True, num_classes=101).to(device)
    student = DDP(student, device_ids=[local_rank])

    opt = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for it, (xw, xs, y) in enumerate(train_loader):
            xw, xs, y = xw.to(device, non_blocking=True), xs.to(device, non_blocking=True), y.to(device)
            xs = cutmix(xs, args.cutmix_p)
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.no_grad():
                    t_logits = teacher(xs)
                logits_w = student(xw)
                logits_s = student(xs)
                ce = F.cross_entropy(logits_w, y, label_smoothing=0.1)
                kd = F.kl_div(F.log_softmax(logits_s.float() / args.T, 1),
                              F.softmax(t_logits.float() / args.T, 1), reduction="batchmean") * args.T ** 2
                loss = ce + args.w_kd * kd
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} ce {ce.item():.3f} kd {kd.item():.3f}", flush=True)

        acc = evaluate(student, test_loader, device)
        if rank == 0:
            print(f"epoch {epoch} top1 {acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            torch.save({"epoch": epoch, "model": student.module.state_dict(), "opt": opt.state_dict()},
                       os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(student.module.state_dict(), os.path.join(args.out, "best.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
