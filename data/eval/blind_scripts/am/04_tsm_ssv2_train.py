#!/usr/bin/env python3
# TSM-R50 on Something-Something V2 (8 segments, frames pre-extracted as JPEG).
#
#   torchrun --standalone --nproc_per_node=8 04_tsm_ssv2_train.py --frames /data/ssv2/frames \
#       --ann /data/ssv2/annotations --epochs 45 --lr 0.01 --batch-size 8
import argparse
import json
import os
import shutil
import time

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms


class TemporalShift(nn.Module):
    def __init__(self, net, n_segment=8, fold_div=8):
        super().__init__()
        self.net, self.n_segment, self.fold_div = net, n_segment, fold_div

    def forward(self, x):
        nt, c, h, w = x.size()
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


class TSM(nn.Module):
    def __init__(self, num_classes, n_segment=8, dropout=0.5, pretrained=True):
        super().__init__()
        self.n_segment = n_segment
        weights = torchvision.models.ResNet50_Weights.IMAGENET1K_V1 if pretrained else None
        base = torchvision.models.resnet50(weights=weights)
        for layer in [base.layer1, base.layer2, base.layer3, base.layer4]:
            for b in layer:
                b.conv1 = TemporalShift(b.conv1, n_segment)
        base.fc = nn.Sequential(nn.Dropout(dropout), nn.Linear(2048, num_classes))
        self.base = base

    def forward(self, x):
        # x: B, T, C, H, W
        b, t = x.shape[:2]
        out = self.base(x.flatten(0, 1))
        return out.view(b, t, -1).mean(1)


class SSV2Frames(Dataset):
    def __init__(self, frame_root, ann_file, label_file, n_segment=8, train=True):
        with open(label_file) as f:
            self.template_to_id = {k: int(v) for k, v in json.load(f).items()}
        with open(ann_file) as f:
            anns = json.load(f)
        self.items = []
        for a in anns:
            vdir = os.path.join(frame_root, a["id"])
            n = len(os.listdir(vdir)) if os.path.isdir(vdir) else 0
            if n < 1:
                continue
            tmpl = a["template"].replace("[", "").replace("]", "")
            self.items.append((vdir, n, self.template_to_id[tmpl]))
        self.n_segment, self.train = n_segment, train
        normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if train:
            # no horizontal flip on SSv2: left/right is part of the label
            self.tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.35, 1.0)),
                                          transforms.ToTensor(), normalize])
        else:
            self.tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                          transforms.ToTensor(), normalize])

    def __len__(self):
        return len(self.items)

    def _indices(self, n):
        seg = n / self.n_segment
        if self.train:
            return [min(int(seg * i + torch.rand(1).item() * seg), n - 1) for i in range(self.n_segment)]
        return [min(int(seg * i + seg / 2), n - 1) for i in range(self.n_segment)]

    def __getitem__(self, i):
        vdir, n, label = self.items[i]
        idxs = self._indices(n)
        seed = torch.randint(0, 2 ** 31, (1,)).item()
        frames = []
        for j in idxs:
            img = Image.open(os.path.join(vdir, f"{j + 1:06d}.jpg")).convert("RGB")
            torch.manual_seed(seed)  # same crop for every frame of the clip
            frames.append(self.tf(img))
        return torch.stack(frames), label


def accuracy(output, target, topk=(1, 5)):
    _, pred = output.topk(max(topk), 1, True, True)
    correct = pred.eq(target.view(-1, 1))
    return [correct[:, :k].any(1).float().sum() for k in topk]


def train_one_epoch(model, loader, optimizer, scaler, criterion, epoch, args, rank):
    model.train()
    t0 = time.time()
    for i, (x, y) in enumerate(loader):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 20)
        scaler.step(optimizer)
        scaler.update()
        if rank == 0 and i % args.print_freq == 0:
            print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {loss.item():.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.5f} time {time.time() - t0:.1f}s", flush=True)


@torch.no_grad()
def validate(model, loader):
    model.eval()
    total = torch.zeros(3, device="cuda")
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.cuda.amp.autocast():
            out = model(x)
        c1, c5 = accuracy(out, y)
        total += torch.stack([c1, c5, torch.tensor(float(y.numel()), device="cuda")])
    dist.all_reduce(total)
    return (100 * total[0] / total[2]).item(), (100 * total[1] / total[2]).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--frames", required=True)
    p.add_argument("--ann", required=True)
    p.add_argument("--epochs", type=int, default=45)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--lr-steps", type=int, nargs="+", default=[20, 40])
    p.add_argument("--wd", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--print-freq", type=int, default=50)
    p.add_argument("--save-dir", default="checkpoints/tsm_ssv2")
    p.add_argument("--resume", default="")
    args = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    cudnn.benchmark = True

    labels = os.path.join(args.ann, "labels.json")
    train_set = SSV2Frames(args.frames, os.path.join(args.ann, "train.json"), labels, train=True)
    val_set = SSV2Frames(args.frames, os.path.join(args.ann, "validation.json"), labels, train=False)
    val_subset = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world)))

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_subset, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    model = TSM(num_classes=len(train_set.template_to_id)).cuda()
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss().cuda()

    start_epoch, best = 0, 0.0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{local_rank}")
        model.module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"], ckpt["best_prec1"]

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"train clips: {len(train_set)}  val clips: {len(val_set)}  world: {world}")

    for epoch in range(start_epoch, args.epochs):
        train_one_epoch(model, train_loader, optimizer, scaler, criterion, epoch, args, rank)
        scheduler.step()
        prec1, prec5 = validate(model.module, val_loader)
        if rank == 0:
            is_best = prec1 > best
            best = max(best, prec1)
            print(f"Epoch {epoch}: val top1 {prec1:.2f} top5 {prec5:.2f} (best {best:.2f})", flush=True)
            path = os.path.join(args.save_dir, "ckpt.pth.tar")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "best_prec1": best}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.save_dir, "best.pth.tar"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
