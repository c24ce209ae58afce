"""Fine-tune a Kinetics-pretrained R3D-18 on UCF-101 (split 1).

UCF-101 layout:
    <root>/UCF-101/<Class>/v_<Class>_gXX_cYY.avi
    <root>/ucfTrainTestlist/{classInd.txt, trainlist01.txt, testlist01.txt}

Usage:
    torchrun --nproc_per_node=4 05_r3d_ucf101_finetune.py --root /data/ucf101 \
        --pretrained /models/r3d_18-b3b3357e.pth --out runs/r3d_ucf101_s1
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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models.video import r3d_18

torchvision.set_video_backend("pyav")

KINETICS_MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
KINETICS_STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--split", type=int, default=1)
    ap.add_argument("--pretrained", default="")
    ap.add_argument("--out", default="runs/r3d_ucf101")
    ap.add_argument("--clip-len", type=int, default=16)
    ap.add_argument("--frame-stride", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.01, help="for a global batch of 128")
    ap.add_argument("--lr-steps", type=int, nargs="+", default=[15, 25])
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


def load_split(root, split):
    lists = os.path.join(root, "ucfTrainTestlist")
    with open(os.path.join(lists, "classInd.txt")) as f:
        # classInd.txt is 1-based: "1 ApplyEyeMakeup"
        class_idx = {name: int(i) - 1 for i, name in (line.split() for line in f if line.strip())}

    def read(fname):
        out = []
        with open(os.path.join(lists, fname)) as f:
            for line in f:
                if not line.strip():
                    continue
                rel = line.split()[0]
                out.append((os.path.join(root, "UCF-101", rel), class_idx[rel.split("/")[0]]))
        return out

    return read(f"trainlist0{split}.txt"), read(f"testlist0{split}.txt"), len(class_idx)


class UCFClips(Dataset):
    def __init__(self, samples, clip_len, stride, train):
        self.samples, self.clip_len, self.stride, self.train = samples, clip_len, stride, train

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        video, _, _ = torchvision.io.read_video(path, pts_unit="sec", output_format="TCHW")
        n = video.shape[0]
        span = self.clip_len * self.stride
        start = random.randint(0, max(n - span, 0)) if self.train else max(n - span, 0) // 2
        idx = torch.arange(start, start + span, self.stride).clamp(max=n - 1)
        x = video[idx].float() / 255.0
        x = F.interpolate(x, size=(128, 171), mode="bilinear", align_corners=False)
        if self.train:
            top, left = random.randint(0, 128 - 112), random.randint(0, 171 - 112)
        else:
            top, left = 8, 29
        x = x[:, :, top:top + 112, left:left + 112]
        if self.train and random.random() < 0.5:
            x = x.flip(-1)
        x = x.permute(1, 0, 2, 3)
        return (x - KINETICS_MEAN) / KINETICS_STD, label


class EvalShard(torch.utils.data.Sampler):
    def __init__(self, dataset, world, rank):
        self.ids = list(range(rank, len(dataset), world))

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


def train_epoch(model, loader, optimizer, scaler, device, epoch, rank):
    model.train()
    running = torch.zeros(3, device=device)  # loss sum, correct, count
    t0 = time.time()
    for step, (clips, labels) in enumerate(loader):
        clips = clips.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(clips)
            loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        running[0] += loss.detach().float() * labels.size(0)
        running[1] += (logits.argmax(1) == labels).sum()
        running[2] += labels.size(0)
        if rank == 0 and step % 25 == 0:
            print(f"[{epoch}][{step}/{len(loader)}] loss {loss.item():.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    dist.all_reduce(running)
    return (running[0] / running[2]).item(), (100 * running[1] / running[2]).item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for clips, labels in loader:
        clips = clips.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            logits = model(clips)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
        total += labels.size(0)
    stats = torch.tensor([correct, total, loss_sum], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    correct, total, loss_sum = stats.tolist()
    return 100.0 * correct / total, loss_sum / total


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)

    train_samples, test_samples, num_classes = load_split(args.root, args.split)
    train_ds = UCFClips(train_samples, args.clip_len, args.frame_stride, train=True)
    test_ds = UCFClips(test_samples, args.clip_len, args.frame_stride, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True, drop_last=True)
    test_dl = DataLoader(test_ds, batch_size=args.batch_size, sampler=EvalShard(test_ds, world, rank),
                         num_workers=args.workers, pin_memory=True)

    model = r3d_18()
    if args.pretrained:
        model.load_state_dict(torch.load(args.pretrained, map_location="cpu"))
    model.fc = nn.Linear(model.fc.in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world / 128
    backbone = [p for n, p in model.module.named_parameters() if not n.startswith("fc.")]
    optimizer = torch.optim.SGD([{"params": backbone, "lr": lr * 0.1},
                                 {"params": model.module.fc.parameters(), "lr": lr}],
                                momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.lr_steps, gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    writer = SummaryWriter(args.out) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train_loss, train_acc = train_epoch(model, train_dl, optimizer, scaler, device, epoch, rank)
        scheduler.step()
        val_acc, val_loss = evaluate(model.module, test_dl, device)
        if rank == 0:
            writer.add_scalars("loss", {"train": train_loss, "val": val_loss}, epoch)
            writer.add_scalars("acc", {"train": train_acc, "val": val_acc}, epoch)
            print(f"epoch {epoch}: train {train_acc:.2f}% val {val_acc:.2f}% (clip-level)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if val_acc > best:
                best = val_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pth"))

    if rank == 0:
        print(f"best clip accuracy {best:.2f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
