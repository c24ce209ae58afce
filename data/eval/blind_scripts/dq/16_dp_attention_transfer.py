"""Attention-transfer distillation (Zagoruyko & Komodakis) on the 4-GPU workstation.

Teacher ResNet-50 and student ResNet-18 (vehicle-type classifier for the roadside
unit), both torchvision. Intermediate activations are captured with forward hooks on
layer1..layer4 and compared as normalised spatial attention maps.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 16_dp_attention_transfer.py --data /data/vehicle_types \
        --teacher-ckpt weights/r50_vehicle_types.pth
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import models, transforms
from torchvision.datasets import ImageFolder

AT_LAYERS = ("layer1", "layer2", "layer3", "layer4")


class FeatureRecorder:
    """Stores the output of the named sub-modules every time the model runs."""

    def __init__(self, model, names):
        self.feats = {}
        self.handles = []
        for name in names:
            module = dict(model.named_modules())[name]
            self.handles.append(module.register_forward_hook(self._make_hook(name)))

    def _make_hook(self, name):
        def hook(module, inputs, output):
            self.feats[name] = output
        return hook

    def clear(self):
        self.feats = {}

    def remove(self):
        for h in self.handles:
            h.remove()


def attention_map(f, p=2):
    am = f.pow(p).mean(1).flatten(1)
    return F.normalize(am, dim=1)


def at_loss(fs, ft):
    if fs.shape[-2:] != ft.shape[-2:]:
        fs = F.interpolate(fs, size=ft.shape[-2:], mode="bilinear", align_corners=False)
    return (attention_map(fs) - attention_map(ft)).pow(2).mean()


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--num-classes", type=int, default=14)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=256, help="total, split over the GPUs")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=1000.0, help="AT loss weight")
    p.add_argument("--T", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--out", default="runs/at_r18")
    return p.parse_args()


def main():
    args = parse_args()
    device = torch.device("cuda:0")
    n_gpus = torch.cuda.device_count()

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_ds = ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.Resize((192, 256)), transforms.RandomHorizontalFlip(), transforms.Pad(10),
        transforms.RandomCrop((192, 256)), transforms.ToTensor(), norm]))
    val_ds = ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize((192, 256)), transforms.ToTensor(), norm]))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=512, shuffle=False, num_workers=args.workers, pin_memory=True)

    teacher = models.resnet50(num_classes=args.num_classes)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu"))
    teacher.eval().requires_grad_(False)
    student = models.resnet18(weights="IMAGENET1K_V1")
    student.fc = nn.Linear(student.fc.in_features, args.num_classes)

    t_rec = FeatureRecorder(teacher, AT_LAYERS)
    s_rec = FeatureRecorder(student, AT_LAYERS)

    teacher = nn.DataParallel(teacher.to(device))
    student = nn.DataParallel(student.to(device))

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    os.makedirs(args.out, exist_ok=True)
    print(f"training on {n_gpus} GPUs, batch {args.batch_size}", flush=True)

    best = 0.0
    for epoch in range(args.epochs):
        student.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t_rec.clear()
            s_rec.clear()
            with torch.no_grad():
                t_logits = teacher(x)
            s_logits = student(x)

            loss_at = sum(at_loss(s_rec.feats[k], t_rec.feats[k].to(s_rec.feats[k].device))
                          for k in AT_LAYERS) / len(AT_LAYERS)
            loss_kd = F.kl_div(F.log_softmax(s_logits / args.T, 1), F.softmax(t_logits / args.T, 1),
                               reduction="batchmean") * args.T ** 2
            loss = F.cross_entropy(s_logits, y) + 0.5 * loss_kd + args.beta / 2 * loss_at

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"at {loss_at.item():.5f} kd {loss_kd.item():.4f}", flush=True)
        scheduler.step()

        student.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                correct += (student(x).argmax(1) == y).sum().item()
                total += y.numel()
        acc = 100.0 * correct / total
        print(f"epoch {epoch} val acc {acc:.2f} time {time.time() - t0:.0f}s", flush=True)
        torch.save({"model": student.module.state_dict(), "epoch": epoch, "acc": acc},
                   os.path.join(args.out, "last.pth"))
        if acc > best:
            best = acc
            torch.save(student.module.state_dict(), os.path.join(args.out, "best.pth"))

    s_rec.remove()
    t_rec.remove()


if __name__ == "__main__":
    main()
