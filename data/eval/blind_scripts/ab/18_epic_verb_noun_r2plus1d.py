"""EPIC-Kitchens verb/noun recognition with an R(2+1)D-34 backbone and two heads.

    torchrun --nnodes=1 --nproc_per_node=8 --max-restarts=4 18_epic_verb_noun_r2plus1d.py \
        --root /datasets/epic100 --out /shared/video/r2p1d_epic
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import r2plus1d_18, R2Plus1D_18_Weights

N_VERBS, N_NOUNS = 97, 300


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--bs", type=int, default=12)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--workers", type=int, default=10)
    return p.parse_args()


class EpicClips(Dataset):
    MEAN = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
    STD = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __init__(self, root, split, frames, stride, train):
        self.df = pd.read_csv(os.path.join(root, "annotations", f"EPIC_100_{split}.csv"))
        self.frame_dir = os.path.join(root, "rgb_frames")
        self.frames, self.stride, self.train = frames, stride, train

    def __len__(self):
        return len(self.df)

    def _load(self, vid, idx):
        p = os.path.join(self.frame_dir, vid.split("_")[0], vid, f"frame_{idx:010d}.jpg")
        return np.asarray(Image.open(p).convert("RGB").resize((171, 128)))

    def __getitem__(self, i):
        r = self.df.iloc[i]
        span = self.frames * self.stride
        lo, hi = int(r.start_frame), int(r.stop_frame)
        if self.train:
            start = random.randint(lo, max(lo, hi - span))
        else:
            start = max(lo, (lo + hi - span) // 2)
        idxs = [min(start + k * self.stride, hi) for k in range(self.frames)]
        clip = torch.from_numpy(np.stack([self._load(r.video_id, j) for j in idxs]))  # T H W C
        clip = clip.permute(3, 0, 1, 2).float() / 255.0
        if self.train:
            y0, x0 = random.randint(0, 128 - 112), random.randint(0, 171 - 112)
            if random.random() < 0.5:
                clip = clip.flip(-1)
        else:
            y0, x0 = 8, 29
        clip = clip[:, :, y0:y0 + 112, x0:x0 + 112]
        clip = (clip - self.MEAN) / self.STD
        return clip, int(r.verb_class), int(r.noun_class)


class VerbNounNet(nn.Module):
    def __init__(self):
        super().__init__()
        net = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
        feat = net.fc.in_features
        net.fc = nn.Identity()
        self.backbone = net
        self.drop = nn.Dropout(0.5)
        self.verb = nn.Linear(feat, N_VERBS)
        self.noun = nn.Linear(feat, N_NOUNS)

    def forward(self, x):
        f = self.drop(self.backbone(x))
        return self.verb(f), self.noun(f)


def checkpoints(out):
    return sorted(glob.glob(os.path.join(out, "epoch_*.pth")))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(4, device=device)
    for clip, v, n in loader:
        clip, v, n = clip.to(device, non_blocking=True), v.to(device), n.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            lv, ln = model.module(clip)
        pv, pn = lv.argmax(1), ln.argmax(1)
        s[0] += (pv == v).sum()
        s[1] += (pn == n).sum()
        s[2] += ((pv == v) & (pn == n)).sum()
        s[3] += v.numel()
    dist.all_reduce(s)
    model.train()
    return (s[:3] / s[3]).tolist()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()

    train_ds = EpicClips(args.root, "train", args.frames, args.stride, True)
    val_ds = EpicClips(args.root, "validation", args.frames, args.stride, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.bs, num_workers=args.workers, pin_memory=True)

    model = VerbNounNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.bs / 64, momentum=0.9,
                          weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[20, 30], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch, best = 0, 0.0
    found = checkpoints(args.out)
    if found:
        ck = torch.load(found[-1])
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
        if rank == 0:
            print(f"resumed from {found[-1]} -> epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(3, device=device)
        for step, (clip, v, n) in enumerate(train_dl):
            clip = clip.to(device, non_blocking=True)
            v, n = v.to(device, non_blocking=True), n.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                lv, ln = model(clip)
                loss_v = F.cross_entropy(lv, v)
                loss_n = F.cross_entropy(ln, n)
                loss = loss_v + loss_n
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot += torch.stack([loss_v.detach().float(), loss_n.detach().float(),
                                torch.ones((), device=device)])
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} {step}/{len(train_dl)} verb {loss_v.item():.3f} "
                      f"noun {loss_n.item():.3f} {(time.time() - t0) / (step + 1):.2f}s/it", flush=True)
        sched.step()
        dist.all_reduce(tot)

        verb_acc, noun_acc, action_acc = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: loss_v {(tot[0] / tot[2]).item():.3f} loss_n {(tot[1] / tot[2]).item():.3f} "
                  f"verb {verb_acc:.4f} noun {noun_acc:.4f} action {action_acc:.4f}", flush=True)
            if action_acc > best:
                best = action_acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_action.pth"))
            path = os.path.join(args.out, f"epoch_{epoch:03d}.pth")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "best": best}, path + ".tmp")
            os.replace(path + ".tmp", path)
            for old in checkpoints(args.out)[:-args.keep]:
                os.remove(old)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
