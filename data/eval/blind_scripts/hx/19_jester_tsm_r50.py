"""Temporal Shift Module (ResNet-50) on 20BN-Jester hand gestures (27 classes).

    torchrun --nproc_per_node=8 19_jester_tsm_r50.py --root /data/jester --wandb-project gestures
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms.v2 as T
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class TemporalShift(nn.Module):
    def __init__(self, net, n_segment, fold_div=8):
        super().__init__()
        self.net = net
        self.n_segment = n_segment
        self.fold_div = fold_div

    def forward(self, x):
        nt, c, h, w = x.size()
        x = x.view(nt // self.n_segment, self.n_segment, c, h, w)
        fold = c // self.fold_div
        out = torch.zeros_like(x)
        out[:, :-1, :fold] = x[:, 1:, :fold]  # shift left
        out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]  # shift right
        out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
        return self.net(out.view(nt, c, h, w))


class TSN(nn.Module):
    def __init__(self, num_classes, n_segment=8, dropout=0.5):
        super().__init__()
        self.n_segment = n_segment
        base = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        for layer in (base.layer1, base.layer2, base.layer3, base.layer4):
            for block in layer:
                block.conv1 = TemporalShift(block.conv1, n_segment)
        base.fc = nn.Identity()
        self.base = base
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):  # x: B, T, C, H, W
        b, t = x.shape[:2]
        feat = self.base(x.flatten(0, 1))
        logits = self.fc(self.dropout(feat)).view(b, t, -1)
        return logits.mean(1)  # average consensus


class JesterFrames(Dataset):
    def __init__(self, root, split, labels, n_segment, train):
        self.frames_dir = os.path.join(root, "20bn-jester-v1")
        with open(os.path.join(root, f"jester-v1-{split}.csv")) as f:
            rows = [line.strip().split(";") for line in f if line.strip()]
        self.items = [(vid, labels[lab]) for vid, lab in rows]
        self.n_segment = n_segment
        self.train = train
        if train:
            # no horizontal flip: it swaps "swiping left" and "swiping right"
            self.tf = T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0)), T.ColorJitter(0.2, 0.2, 0.2)])
        else:
            self.tf = T.Compose([T.Resize(256), T.CenterCrop(224)])
        self.norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        vid, label = self.items[i]
        d = os.path.join(self.frames_dir, vid)
        n = len(os.listdir(d))
        seg = n / self.n_segment
        if self.train:
            idx = [int(seg * k + random.random() * seg) for k in range(self.n_segment)]
        else:
            idx = [int(seg * k + seg / 2) for k in range(self.n_segment)]
        imgs = [T.functional.pil_to_tensor(Image.open(os.path.join(d, f"{j + 1:05d}.jpg")).convert("RGB"))
                for j in idx]
        clip = self.tf(torch.stack(imgs))  # same crop for all frames
        return self.norm(clip.float() / 255.0), label


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/jester")
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--lr", type=float, default=0.01, help="for 8 GPUs x 8 clips")
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--wandb-project", default="gestures")
    p.add_argument("--run-name", default="tsm_r50_jester")
    p.add_argument("--ckpt-dir", default="checkpoints/tsm_jester")
    return p.parse_args()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    with open(os.path.join(args.root, "jester-v1-labels.csv")) as f:
        classes = [line.strip() for line in f if line.strip()]
    labels = {c: i for i, c in enumerate(classes)}
    train_set = JesterFrames(args.root, "train", labels, args.segments, train=True)
    val_set = JesterFrames(args.root, "validation", labels, args.segments, train=False)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_subset = torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_subset, 16, num_workers=args.workers, pin_memory=True)

    model = TSN(len(classes), args.segments).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * (args.batch_size * world_size) / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for step, (clips, y) in enumerate(train_loader):
            clips, y = clips.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(clips), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 20)
            optimizer.step()
            if step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": optimizer.param_groups[0]["lr"],
                           "epoch": epoch + step / len(train_loader)})
        scheduler.step()

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for clips, y in val_loader:
                clips, y = clips.to(device, non_blocking=True), y.to(device, non_blocking=True)
                correct[0] += (model(clips).argmax(1) == y).sum()
                correct[1] += y.numel()
        dist.all_reduce(correct)
        acc = (correct[0] / correct[1]).item()

        if rank == 0:
            print(f"epoch {epoch} val acc {acc * 100:.2f} ({time.time() - tic:.0f}s)", flush=True)
            wandb.log({"val/acc": acc, "epoch": epoch + 1})
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "classes": classes},
                       os.path.join(args.ckpt_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "classes": classes},
                           os.path.join(args.ckpt_dir, "best.pth"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
