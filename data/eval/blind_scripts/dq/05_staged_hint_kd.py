"""Two-stage hint distillation (FitNets-style) for the ResNet-18 student of the
on-device product classifier.

Stage 1 (first --hint-start epochs): logit KD only, so the student's head settles.
Stage 2: logit KD + intermediate hint losses on layer2/layer3/layer4 through
learnable 1x1 regressors.

Run with:
    torchrun --standalone --nproc_per_node=4 05_staged_hint_kd.py --data /data/products
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import resnet18, resnet101
from torchvision.models.feature_extraction import create_feature_extractor

HINT_LAYERS = ["layer2", "layer3", "layer4"]
STUDENT_CH = {"layer2": 128, "layer3": 256, "layer4": 512}
TEACHER_CH = {"layer2": 512, "layer3": 1024, "layer4": 2048}


def get_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--teacher-weights", default="weights/r101_products.pth")
    parser.add_argument("--num-classes", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--hint-start", type=int, default=10)
    parser.add_argument("--hint-weight", type=float, default=1.0)
    parser.add_argument("--T", type=float, default=4.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--base-lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--save-dir", default="ckpt/hint_kd_r18")
    return parser


class StudentWithRegressors(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = create_feature_extractor(
            resnet18(num_classes=num_classes), return_nodes={**{k: k for k in HINT_LAYERS}, "fc": "logits"})
        self.regressors = nn.ModuleDict({
            k: nn.Sequential(nn.Conv2d(STUDENT_CH[k], TEACHER_CH[k], 1, bias=False),
                             nn.BatchNorm2d(TEACHER_CH[k]))
            for k in HINT_LAYERS
        })

    def forward(self, x, with_hints=True):
        out = self.backbone(x)
        hints = {}
        if with_hints:
            hints = {k: self.regressors[k](out[k]) for k in HINT_LAYERS}
        return out["logits"], hints


def build_teacher(path, num_classes, device):
    model = resnet101(num_classes=num_classes)
    sd = torch.load(path, map_location="cpu")
    model.load_state_dict(sd)
    model = create_feature_extractor(model, return_nodes={**{k: k for k in HINT_LAYERS}, "fc": "logits"})
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad = False
    return model


def kd_term(s, t, T):
    return F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean") * T * T


@torch.no_grad()
def run_eval(model, loader, device):
    model.eval()
    c = torch.zeros(3, device=device)  # correct@1, correct@5, n
    for images, labels in loader:
        images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        logits, _ = model(images, with_hints=False)
        top5 = logits.topk(5, dim=1).indices
        c[0] += (top5[:, 0] == labels).sum()
        c[1] += (top5 == labels[:, None]).any(dim=1).sum()
        c[2] += labels.numel()
    dist.all_reduce(c)
    return (c[0] / c[2]).item() * 100, (c[1] / c[2]).item() * 100


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")

    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_ds = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                            transforms.ToTensor(), normalize]))
    val_ds = datasets.ImageFolder(
        os.path.join(args.data, "val"),
        transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                            transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_ds)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=128, num_workers=args.workers, pin_memory=True)

    teacher = build_teacher(args.teacher_weights, args.num_classes, device)
    model = StudentWithRegressors(args.num_classes).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    iters_per_epoch = len(train_loader)
    total_iters = args.epochs * iters_per_epoch
    warmup_iters = 3 * iters_per_epoch

    def lr_at(it):
        if it < warmup_iters:
            return lr * it / warmup_iters
        return 0.5 * lr * (1 + math.cos(math.pi * (it - warmup_iters) / (total_iters - warmup_iters)))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    best_top1 = 0.0
    it = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        use_hints = epoch >= args.hint_start
        t_start = time.time()
        for images, labels in train_loader:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(it)
            images = images.cuda(non_blocking=True)
            labels = labels.cuda(non_blocking=True)

            with torch.no_grad():
                t_out = teacher(images)

            logits, hints = model(images, with_hints=use_hints)
            loss = 0.9 * kd_term(logits, t_out["logits"], args.T) + 0.1 * F.cross_entropy(logits, labels)
            if use_hints:
                hint_loss = sum(F.mse_loss(hints[k], t_out[k]) for k in HINT_LAYERS) / len(HINT_LAYERS)
                loss = loss + args.hint_weight * hint_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            it += 1

            if rank == 0 and it % 50 == 0:
                print(f"[ep {epoch} it {it}] loss {loss.item():.4f} hints={'on' if use_hints else 'off'} "
                      f"lr {optimizer.param_groups[0]['lr']:.4f}", flush=True)

        top1, top5 = run_eval(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t_start:.0f}s  top1 {top1:.2f}  top5 {top5:.2f}",
                  flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()},
                       os.path.join(args.save_dir, "last.pth"))
            if top1 > best_top1:
                best_top1 = top1
                torch.save(model.module.backbone.state_dict(), os.path.join(args.save_dir, "best_backbone.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
