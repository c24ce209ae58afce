"""NVGesture (25 dynamic hand gestures, in-car) with a 3D ResNet-18 on RGB or depth.

Initialised from our Jester model; long runs are preempted, so the job is resubmitted with
--resume auto.

    torchrun --nproc_per_node=4 14_nvgesture_r3d_resume.py --modality depth \
        --init checkpoints/r3d18_jester.pth --resume auto
"""
import argparse
import glob
import os
import random
import re
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import r3d_18

NUM_CLASSES = 25


def parse_nvgesture_list(list_file, root, modality):
    """nvgesture_{train,test}_correct_cvpr2016_v2.lst: 'path:... depth:sk_depth:s:e color:sk_color:s:e label:N'"""
    items = []
    with open(list_file) as f:
        for line in f:
            fields = dict(tok.split(":", 1) for tok in line.split())
            name, start, end = fields[modality].split(":")
            video = os.path.join(root, fields["path"].lstrip("./"), name + ".avi")
            items.append((video, int(start), int(end), int(fields["label"]) - 1))
    return items


class NVGestureClips(Dataset):
    def __init__(self, items, clip_len=32, train=True):
        self.items = items
        self.clip_len = clip_len
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, start, end, label = self.items[i]
        if self.train:
            jitter = random.randint(-4, 4)
            idx = np.linspace(start + jitter, end + jitter, self.clip_len)
        else:
            idx = np.linspace(start, end, self.clip_len)
        cap = cv2.VideoCapture(path)
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        wanted = set(np.clip(idx.round().astype(int), 0, n - 1).tolist())
        frames, j = {}, 0
        while len(frames) < len(wanted):
            ok, frame = cap.read()
            if not ok:
                break
            if j in wanted:
                frames[j] = cv2.resize(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB), (142, 112))
            j += 1
        cap.release()
        keys = sorted(frames)
        clip = np.stack([frames[min(keys, key=lambda k: abs(k - t))] for t in idx])
        x = torch.from_numpy(clip).permute(3, 0, 1, 2).float().div_(255.0)
        off = random.randint(0, 30) if self.train else 15
        x = x[:, :, :, off:off + 112]
        return (x - 0.45) / 0.225, label


def build_model(init_path=None):
    model = r3d_18(weights=None)
    if init_path:
        state = torch.load(init_path, map_location="cpu")
        state = {k: v for k, v in state["model"].items() if not k.startswith("fc.")}
        missing, _ = model.load_state_dict(state, strict=False)
        assert set(missing) <= {"fc.weight", "fc.bias"}, missing
    model.fc = nn.Linear(512, NUM_CLASSES)
    return model


def find_last_checkpoint(ckpt_dir):
    files = glob.glob(os.path.join(ckpt_dir, "epoch_*.pth"))
    if not files:
        return None
    return max(files, key=lambda p: int(re.search(r"epoch_(\d+)", p).group(1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/nvGesture_v1")
    ap.add_argument("--modality", choices=["color", "depth"], default="depth")
    ap.add_argument("--init", default="")
    ap.add_argument("--resume", default="", help="checkpoint path or 'auto'")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--ckpt-dir", default="checkpoints/nvgesture_r3d")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_items = parse_nvgesture_list(os.path.join(args.root, "nvgesture_train_correct_cvpr2016_v2.lst"),
                                       args.root, args.modality)
    test_items = parse_nvgesture_list(os.path.join(args.root, "nvgesture_test_correct_cvpr2016_v2.lst"),
                                      args.root, args.modality)
    train_set, test_set = NVGestureClips(train_items, train=True), NVGestureClips(test_items, train=False)
    sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                              drop_last=True)
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world)), args.batch_size,
                             num_workers=8, pin_memory=True)

    model = build_model(args.init)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world / 4, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[30, 45], gamma=0.1)

    start_epoch, best = 0, 0.0
    resume = find_last_checkpoint(args.ckpt_dir) if args.resume == "auto" else args.resume
    if resume:
        ckpt = torch.load(resume)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best = ckpt["epoch"] + 1, ckpt["best"]
        if rank == 0:
            print(f"resumed from {resume} at epoch {start_epoch}")
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        tic = time.time()
        for it, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if rank == 0 and it % 20 == 0:
                print(f"epoch {epoch} [{it}/{len(train_loader)}] loss {loss.item():.4f}", flush=True)
        scheduler.step()

        model.eval()
        res = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in test_loader:
                res[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
                res[1] += y.numel()
        dist.all_reduce(res)
        acc = (res[0] / res[1]).item()
        best = max(best, acc)
        if rank == 0:
            print(f"epoch {epoch} test acc {acc * 100:.2f} (best {best * 100:.2f}) {time.time() - tic:.0f}s")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best},
                       os.path.join(args.ckpt_dir, f"epoch_{epoch:03d}.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
