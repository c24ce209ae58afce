"""EPIC-KITCHENS-100 action recognition with a two-head R(2+1)D-34 style network.

One backbone, a verb head (97 classes) and a noun head (300 classes). `--task` picks
which heads are trained; the action score at test time is verb x noun.

  torchrun --nproc_per_node=8 17_epic100_verb_noun_r2plus1d.py --frames /data/epic/rgb_frames \
      --ann-dir /data/epic/annotations --task verb
"""
import argparse
import os
import random
import time

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18

NUM_VERBS, NUM_NOUNS = 97, 300


class EpicSegments(Dataset):
    def __init__(self, frame_root, csv_file, num_frames=16, train=True):
        self.df = pd.read_csv(csv_file)
        self.frame_root, self.num_frames, self.train = frame_root, num_frames, train
        self.tf = T.Compose([
            T.Resize(128),
            T.RandomCrop(112) if train else T.CenterCrop(112),
            T.ToTensor(),
            T.Normalize([0.43216, 0.394666, 0.37645], [0.22803, 0.22145, 0.216989]),
        ])

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        start, stop = int(r.start_frame), int(r.stop_frame)
        n = max(stop - start + 1, 1)
        seg = n / self.num_frames
        offs = [int(seg * k + (random.random() if self.train else 0.5) * seg) for k in range(self.num_frames)]
        flip = self.train and random.random() < 0.5
        seed = random.randrange(2 ** 31)
        frames = []
        for o in offs:
            p = os.path.join(self.frame_root, r.participant_id, r.video_id, f"frame_{start + o:010d}.jpg")
            img = Image.open(p).convert("RGB")
            torch.manual_seed(seed)  # same crop for every frame of the segment
            x = self.tf(img)
            frames.append(x.flip(-1) if flip else x)
        clip = torch.stack(frames, 1)                  # C T H W
        return clip, int(r.verb_class), int(r.noun_class)


class TwoHeadR2Plus1D(nn.Module):
    def __init__(self, dropout=0.5):
        super().__init__()
        net = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
        net.fc = nn.Identity()
        self.backbone = net
        self.dropout = nn.Dropout(dropout)
        self.fc_verb = nn.Linear(512, NUM_VERBS)
        self.fc_noun = nn.Linear(512, NUM_NOUNS)

    def forward(self, x):
        f = self.dropout(self.backbone(x))
        return self.fc_verb(f), self.fc_noun(f)


def compute_loss(verb_logits, noun_logits, verb, noun, task):
    if task == "verb":
        return F.cross_entropy(verb_logits, verb)
    if task == "noun":
        return F.cross_entropy(noun_logits, noun)
    return 0.5 * (F.cross_entropy(verb_logits, verb) + F.cross_entropy(noun_logits, noun))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(5, device=device)  # verb top1, verb top5, noun top1, noun top5, action top1
    for clip, verb, noun in loader:
        clip, verb, noun = clip.to(device), verb.to(device), noun.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            vl, nl = model(clip)
        v5, n5 = vl.topk(5, 1).indices, nl.topk(5, 1).indices
        s[0] += (v5[:, 0] == verb).sum()
        s[1] += (v5 == verb[:, None]).any(1).sum()
        s[2] += (n5[:, 0] == noun).sum()
        s[3] += (n5 == noun[:, None]).any(1).sum()
        s[4] += ((v5[:, 0] == verb) & (n5[:, 0] == noun)).sum()
    n = torch.tensor(float(len(loader.dataset)), device=device)
    dist.all_reduce(s)
    dist.all_reduce(n)
    return (100 * s / n).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", required=True)
    ap.add_argument("--ann-dir", required=True)
    ap.add_argument("--task", choices=["verb", "noun", "both"], default="verb")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="runs/epic100")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    train_set = EpicSegments(args.frames, os.path.join(args.ann_dir, "EPIC_100_train.csv"), train=True)
    val_set = EpicSegments(args.frames, os.path.join(args.ann_dir, "EPIC_100_validation.csv"), train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world)),
                            batch_size=args.batch_size, num_workers=args.workers, pin_memory=True)

    model = TwoHeadR2Plus1D()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    backbone_params = list(model.module.backbone.parameters())
    head_params = list(model.module.fc_verb.parameters()) + list(model.module.fc_noun.parameters())
    optimizer = torch.optim.SGD([{"params": backbone_params, "lr": args.lr},
                                 {"params": head_params, "lr": args.lr * 10}],
                                momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [20, 25], 0.1)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (clip, verb, noun) in enumerate(train_loader):
            clip, verb, noun = clip.to(device, non_blocking=True), verb.to(device), noun.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                verb_logits, noun_logits = model(clip)
                loss = compute_loss(verb_logits, noun_logits, verb, noun, args.task)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 50 == 0:
                print(f"[{epoch}][{it}/{len(train_loader)}] {args.task} loss {loss.item():.4f} "
                      f"{time.time() - t0:.0f}s", flush=True)
        scheduler.step()

        v1, v5, n1, n5, a1 = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: verb {v1:.2f}/{v5:.2f} noun {n1:.2f}/{n5:.2f} action {a1:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "task": args.task}, os.path.join(args.out, f"{args.task}_last.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
