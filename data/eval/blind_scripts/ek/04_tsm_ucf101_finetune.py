"""Fine-tune a Kinetics-pretrained TSM on UCF101 (split 1).

    torchrun --nproc_per_node=4 04_tsm_ucf101_finetune.py \
        --root /data/ucf101/videos --split-dir /data/ucf101/splits \
        --pretrained ckpts/TSM_kinetics_RGB_resnet50_shift8_blockres_avg_segment8_e50.pth
"""
import argparse
import os
import shutil
import time

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser(description="TSM fine-tuning on UCF101")
parser.add_argument("--root", type=str, required=True)
parser.add_argument("--split-dir", type=str, required=True)
parser.add_argument("--split", type=int, default=1)
parser.add_argument("--pretrained", type=str, default="")
parser.add_argument("--num-segments", type=int, default=8)
parser.add_argument("--epochs", type=int, default=25)
parser.add_argument("--batch-size", type=int, default=16, help="per GPU")
parser.add_argument("--lr", type=float, default=0.001, help="lr for total batch 64")
parser.add_argument("--lr-steps", type=int, nargs="+", default=[10, 20])
parser.add_argument("--weight-decay", type=float, default=5e-4)
parser.add_argument("--workers", type=int, default=6)
parser.add_argument("--log-dir", type=str, default="log/tsm_ucf101")
parser.add_argument("--local_rank", type=int, default=0)


def temporal_shift(x, n_segment, fold_div=8):
    nt, c, h, w = x.size()
    x = x.view(nt // n_segment, n_segment, c, h, w)
    fold = c // fold_div
    out = torch.zeros_like(x)
    out[:, :-1, :fold] = x[:, 1:, :fold]
    out[:, 1:, fold:2 * fold] = x[:, :-1, fold:2 * fold]
    out[:, :, 2 * fold:] = x[:, :, 2 * fold:]
    return out.view(nt, c, h, w)


class ShiftConv(nn.Module):
    def __init__(self, conv, n_segment):
        super().__init__()
        self.net = conv
        self.n_segment = n_segment

    def forward(self, x):
        return self.net(temporal_shift(x, self.n_segment))


class TSN(nn.Module):
    def __init__(self, num_class, num_segments, dropout=0.8):
        super().__init__()
        self.num_segments = num_segments
        self.base_model = torchvision.models.resnet50()
        for stage in (self.base_model.layer1, self.base_model.layer2, self.base_model.layer3, self.base_model.layer4):
            for b in stage:
                b.conv1 = ShiftConv(b.conv1, num_segments)
        self.base_model.fc = nn.Dropout(p=dropout)
        self.new_fc = nn.Linear(2048, num_class)
        nn.init.normal_(self.new_fc.weight, 0, 0.001)
        nn.init.constant_(self.new_fc.bias, 0)

    def forward(self, x):
        n = x.size(0)
        out = self.new_fc(self.base_model(x.view((-1,) + x.shape[-3:])))
        return out.view(n, self.num_segments, -1).mean(dim=1)


class UCF101(Dataset):
    def __init__(self, root, split_dir, split, train, num_segments):
        self.root, self.train, self.num_segments = root, train, num_segments
        with open(os.path.join(split_dir, "classInd.txt")) as f:
            self.cls = {l.split()[1]: int(l.split()[0]) - 1 for l in f if l.strip()}
        name = f"{'trainlist' if train else 'testlist'}0{split}.txt"
        with open(os.path.join(split_dir, name)) as f:
            self.videos = [l.split()[0] for l in f if l.strip()]
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, i):
        rel = self.videos[i]
        label = self.cls[rel.split("/")[0]]
        vr = VideoReader(os.path.join(self.root, rel), ctx=cpu(0), width=340, height=256)
        n = len(vr)
        seg = n / self.num_segments
        if self.train:
            idx = (np.arange(self.num_segments) * seg + np.random.rand(self.num_segments) * seg).astype(int)
        else:
            idx = (np.arange(self.num_segments) * seg + seg / 2).astype(int)
        x = torch.from_numpy(vr.get_batch(np.minimum(idx, n - 1)).asnumpy()).permute(0, 3, 1, 2).float() / 255
        if self.train:
            scale = np.random.choice([256, 224, 192, 168])
            top, left = np.random.randint(0, 256 - scale + 1), np.random.randint(0, 340 - scale + 1)
            x = F.interpolate(x[..., top:top + scale, left:left + scale], size=(224, 224), mode="bilinear",
                              align_corners=False)
            if np.random.rand() < 0.5:
                x = torch.flip(x, dims=[-1])
        else:
            x = x[..., 16:240, 58:282]
        return (x - self.mean) / self.std, label


def adjust_learning_rate(optimizer, epoch, base_lr, lr_steps):
    lr = base_lr * 0.1 ** sum(epoch >= s for s in lr_steps)
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return lr


def train_one_epoch(model, loader, criterion, optimizer, epoch, args, writer):
    model.train()
    end = time.time()
    for i, (clips, target) in enumerate(loader):
        clips = clips.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        loss = criterion(model(clips), target)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 20)
        optimizer.step()
        if i % 20 == 0:
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            reduced /= dist.get_world_size()
            if dist.get_rank() == 0:
                step = epoch * len(loader) + i
                writer.add_scalar("loss/train", reduced.item(), step)
                print(f"Epoch [{epoch}][{i}/{len(loader)}] loss {reduced.item():.4f} "
                      f"time {time.time() - end:.2f}", flush=True)
        end = time.time()


@torch.no_grad()
def validate(model, loader):
    model.eval()
    correct = torch.zeros(1, device="cuda")
    count = torch.zeros(1, device="cuda")
    for clips, target in loader:
        target = target.cuda(non_blocking=True)
        out = model(clips.cuda(non_blocking=True))
        correct += (out.argmax(1) == target).sum()
        count += target.numel()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    return (correct / count).item() * 100


def main():
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cudnn.benchmark = True

    model = TSN(101, args.num_segments)
    if args.pretrained:
        sd = torch.load(args.pretrained, map_location="cpu")["state_dict"]
        sd = {k.replace("module.", "", 1): v for k, v in sd.items() if "new_fc" not in k}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if rank == 0:
            print("missing:", missing, "unexpected:", unexpected)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])

    train_set = UCF101(args.root, args.split_dir, args.split, True, args.num_segments)
    val_set = UCF101(args.root, args.split_dir, args.split, False, args.num_segments)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_subset = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_subset, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    base_lr = args.lr * args.batch_size * world_size / 64
    fc_params = list(model.module.new_fc.parameters())
    fc_ids = {id(p) for p in fc_params}
    backbone = [p for p in model.parameters() if id(p) not in fc_ids]
    optimizer = torch.optim.SGD([{"params": backbone, "lr_mult": 1.0},
                                 {"params": fc_params, "lr_mult": 5.0}],
                                lr=base_lr, momentum=0.9, weight_decay=args.weight_decay)
    criterion = nn.CrossEntropyLoss().cuda()

    writer = SummaryWriter(args.log_dir) if rank == 0 else None
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        adjust_learning_rate(optimizer, epoch, base_lr, args.lr_steps)
        train_one_epoch(model, train_loader, criterion, optimizer, epoch, args, writer)
        acc = validate(model.module, val_loader)
        if rank == 0:
            writer.add_scalar("acc/val_top1", acc, epoch)
            is_best = acc > best
            best = max(best, acc)
            path = os.path.join(args.log_dir, "ckpt.pth.tar")
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "best_prec1": best}, path)
            if is_best:
                shutil.copyfile(path, os.path.join(args.log_dir, "ckpt.best.pth.tar"))
            print(f"epoch {epoch}: val top1 {acc:.2f} (best {best:.2f})", flush=True)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
