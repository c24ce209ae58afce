"""Player re-identification for multi-object tracking in broadcast soccer.

Crops of tracked players (SoccerNet-Tracking style gt) are used to train an
appearance embedding (ResNet-50 + BNNeck, ID cross-entropy + batch-hard
triplet) with an auxiliary team head (left team / right team / referee / goalkeeper).
Evaluation: query/gallery retrieval within each match, CMC rank-1 and mAP.

Run under Slurm, one task per GPU, e.g.
    sbatch -N 2 --ntasks-per-node=4 --gpus-per-node=4 --cpus-per-task=8 \
        --wrap "srun python 11_player_reid_slurm.py --data /lustre/proj/sn-tracking --out /lustre/proj/exp/reid_r50"
"""
import argparse
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

TEAMS = ["left", "right", "referee", "goalkeeper"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=64, help="crops per GPU")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3.5e-4, help="Adam lr at global batch 256")
    p.add_argument("--margin", type=float, default=0.3)
    return p.parse_args()


def init_distributed_slurm():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], text=True)
        os.environ["MASTER_ADDR"] = hosts.split()[0]
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


def build_crop_index(root, split):
    """One entry per (match, frame, track) crop, with a global player id per match track."""
    items, pid_map = [], {}
    for seq in sorted((root / split).iterdir()):
        gt = np.loadtxt(seq / "gt" / "gt.txt", delimiter=",", usecols=range(6))
        info = json.loads((seq / "tracklets.json").read_text())   # track id -> team role
        for frame, tid, x, y, w, h in gt[::5]:                     # every 5th frame is plenty
            key = f"{seq.name}/{int(tid)}"
            pid = pid_map.setdefault(key, len(pid_map))
            items.append((str(seq / "img1" / f"{int(frame):06d}.jpg"), (x, y, w, h), pid,
                          TEAMS.index(info[str(int(tid))]), seq.name))
    return items, len(pid_map)


def get_index(root, split, rank):
    cache = root / "cache" / f"reid_{split}.json"
    if rank == 0 and not cache.exists():
        items, n = build_crop_index(root, split)
        cache.parent.mkdir(exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"items": items, "num_ids": n}))
        os.replace(tmp, cache)
    dist.barrier()
    d = json.loads(cache.read_text())
    return d["items"], d["num_ids"]


class Crops(Dataset):
    def __init__(self, items, train):
        self.items = items
        norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        self.tf = T.Compose([T.Resize((256, 128)), T.RandomHorizontalFlip(), T.Pad(10), T.RandomCrop((256, 128)),
                             T.ToTensor(), norm, T.RandomErasing(0.5)]) if train else \
            T.Compose([T.Resize((256, 128)), T.ToTensor(), norm])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, (x, y, w, h), pid, team, seq = self.items[i]
        img = Image.open(path).convert("RGB").crop((x, y, x + w, y + h))
        return self.tf(img), pid, team, i


class ReIDNet(nn.Module):
    def __init__(self, num_ids):
        super().__init__()
        r = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
        r.layer4[0].conv2.stride = (1, 1)
        r.layer4[0].downsample[0].stride = (1, 1)
        self.backbone = nn.Sequential(*list(r.children())[:-2])
        self.bnneck = nn.BatchNorm1d(2048)
        self.bnneck.bias.requires_grad_(False)
        self.id_head = nn.Linear(2048, num_ids, bias=False)
        self.team_head = nn.Linear(2048, len(TEAMS))

    def forward(self, x):
        f = F.adaptive_avg_pool2d(self.backbone(x), 1).flatten(1)
        fb = self.bnneck(f)
        if not self.training:
            return F.normalize(fb, dim=1)
        return f, self.id_head(fb), self.team_head(fb)


def batch_hard_triplet(f, pid, margin):
    d = torch.cdist(f, f)
    same = pid[:, None] == pid[None]
    hardest_pos = (d * same).max(1).values
    hardest_neg = (d + 1e5 * same).min(1).values
    return F.relu(hardest_pos - hardest_neg + margin).mean()


def gather_varlen(t, world):
    """all_gather for tensors whose first dim differs between ranks."""
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    max_n = int(max(s.item() for s in sizes))
    padded = torch.zeros((max_n, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate(net, loader, items, device, world):
    net.eval()
    feats, idx = [], []
    for x, _, _, i in loader:
        feats.append(net(x.to(device, non_blocking=True)))
        idx.append(i.to(device))
    feats = gather_varlen(torch.cat(feats), world)
    idx = gather_varlen(torch.cat(idx), world)
    net.train()
    order = idx.argsort()
    feats = feats[order].cpu()
    pids = torch.tensor([items[i][2] for i in idx[order].tolist()])
    seqs = np.array([items[i][4] for i in idx[order].tolist()])
    aps, r1 = [], []
    for q in range(0, len(feats), 10):                       # every 10th crop is a query
        g = (seqs == seqs[q])
        g[q] = False
        g = torch.from_numpy(g)
        sim = feats[g] @ feats[q]
        match = (pids[g] == pids[q])[sim.argsort(descending=True)].float()
        if match.sum() == 0:
            continue
        r1.append(match[0].item())
        hits = match.cumsum(0)
        aps.append(((hits / torch.arange(1, len(match) + 1)) * match).sum().item() / match.sum().item())
    return float(np.mean(r1)), float(np.mean(aps))


def main():
    args = parse_args()
    rank, world, local_rank = init_distributed_slurm()
    device = torch.device("cuda", local_rank)

    train_items, num_ids = get_index(args.data, "train", rank)
    test_items, _ = get_index(args.data, "test", rank)
    train_ds = Crops(train_items, train=True)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=7, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    test_dl = DataLoader(torch.utils.data.Subset(Crops(test_items, train=False), range(rank, len(test_items), world)),
                         batch_size=256, num_workers=7, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(ReIDNet(num_ids)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(0.5 * args.epochs), int(0.8 * args.epochs)], 0.1)

    ckpt_path = args.out / "last.pth"
    start = 0
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"world {world}: {len(train_items)} crops / {num_ids} ids, lr {lr:.2e}, start epoch {start}", flush=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        stats = torch.zeros(3, device=device)
        for x, pid, team, _ in train_dl:
            x, pid, team = x.to(device, non_blocking=True), pid.to(device), team.to(device)
            f, id_logits, team_logits = model(x)
            loss_id = F.cross_entropy(id_logits, pid, label_smoothing=0.1)
            loss = loss_id + batch_hard_triplet(f, pid, args.margin) + 0.2 * F.cross_entropy(team_logits, team)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            stats += torch.stack([loss.detach(), loss_id.detach(), torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(stats)

        if (epoch + 1) % 5 == 0 or epoch + 1 == args.epochs:
            r1, mAP = evaluate(model.module, test_dl, test_items, device, world)
            if rank == 0:
                print(f"epoch {epoch}: rank-1 {r1:.4f} mAP {mAP:.4f}", flush=True)
        if rank == 0:
            print(f"epoch {epoch}: loss {(stats[0] / stats[2]).item():.4f} id {(stats[1] / stats[2]).item():.4f}",
                  flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
