"""SigNet-F style writer-independent feature learning for offline signatures (GPDS-like layout).

The CNN is trained to classify the development signers (genuine signatures) and, jointly,
to tell genuine from skilled forgeries. Verification on held-out signers uses the cosine
distance between a questioned signature and the signer's reference signatures (EER).

Single node, one process per GPU, started from this script:
    python 16_signet_f_spawn_gpds.py --root /data/gpds --gpus 8 --out runs/signet_f
"""
import argparse
import os
import random
import re
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

NAME = re.compile(r"(c|cf)-(\d{3})-(\d{2})\.jpg$")  # c = genuine, cf = forgery


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--out", default="runs/signet_f")
    ap.add_argument("--dev-signers", type=int, default=581)
    ap.add_argument("--n-ref", type=int, default=12)
    ap.add_argument("--lam", type=float, default=0.95, help="weight of the signer loss vs forgery loss")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def index(root):
    table = defaultdict(lambda: {"g": [], "f": []})
    for dirpath, _, files in os.walk(root):
        for fn in sorted(files):
            m = NAME.match(fn)
            if m:
                table[int(m.group(2))]["g" if m.group(1) == "c" else "f"].append(os.path.join(dirpath, fn))
    return {k: {"g": sorted(v["g"]), "f": sorted(v["f"])} for k, v in sorted(table.items())}


def load(path):
    im = Image.open(path).convert("L")
    im.thumbnail((340, 220))                     # keep aspect ratio, fit the canvas
    canvas = Image.new("L", (340, 220), 255)
    canvas.paste(im, ((340 - im.width) // 2, (220 - im.height) // 2))
    a = 1.0 - np.asarray(canvas, dtype=np.float32) / 255.0
    return torch.from_numpy(a)[None]


class DevSet(Dataset):
    def __init__(self, table, signers):
        self.items = []
        for cls, s in enumerate(signers):
            self.items += [(p, cls, 0) for p in table[s]["g"]]
            self.items += [(p, cls, 1) for p in table[s]["f"]]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        p, cls, forged = self.items[i]
        x = load(p)
        if random.random() < 0.5:  # small random shift
            x = torch.roll(x, shifts=(random.randint(-8, 8), random.randint(-12, 12)), dims=(1, 2))
        return x, cls, forged


class Images(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return load(self.paths[i]), i


class SigNetF(nn.Module):
    def __init__(self, n_signers):
        super().__init__()

        def cbr(i, o, k, s=1, p=0):
            return [nn.Conv2d(i, o, k, s, p, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(
            *cbr(1, 96, 11, 4), nn.MaxPool2d(3, 2), *cbr(96, 256, 5, 1, 2), nn.MaxPool2d(3, 2),
            *cbr(256, 384, 3, 1, 1), *cbr(384, 384, 3, 1, 1), *cbr(384, 256, 3, 1, 1), nn.MaxPool2d(3, 2),
            nn.AdaptiveAvgPool2d((3, 5)), nn.Flatten(),
            nn.Linear(256 * 15, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
            nn.Linear(2048, 2048), nn.BatchNorm1d(2048), nn.ReLU(inplace=True),
        )
        self.signer_head = nn.Linear(2048, n_signers)
        self.forgery_head = nn.Linear(2048, 1)

    def forward(self, x):
        f = self.features(x)
        return f, self.signer_head(f), self.forgery_head(f).squeeze(1)


def compute_eer(labels, dists):
    fpr, tpr, _ = roc_curve(labels, -dists)
    k = np.nanargmin(np.abs((1 - tpr) - fpr))
    return float((fpr[k] + 1 - tpr[k]) / 2)


def verification_eer(feats_by_path, table, signers, n_ref, seed=0):
    rng = random.Random(seed)
    labels, dists = [], []
    for s in signers:
        g = list(table[s]["g"])
        rng.shuffle(g)
        refs, qs = g[:n_ref], g[n_ref:]
        R = torch.stack([feats_by_path[p] for p in refs])
        for q, lab in [(q, 1) for q in qs] + [(q, 0) for q in table[s]["f"]]:
            d = 1 - F.cosine_similarity(R, feats_by_path[q][None]).mean().item()
            labels.append(lab)
            dists.append(d)
    return compute_eer(np.array(labels), np.array(dists))


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    random.seed(rank)
    torch.manual_seed(0)

    table = index(args.root)
    signers = sorted(table)
    dev, test = signers[: args.dev_signers], signers[args.dev_signers:]
    train_ds = DevSet(table, dev)
    eval_paths = sorted(p for s in test for kind in ("g", "f") for p in table[s][kind])
    eval_ds = Images(eval_paths)

    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world_size, rank=rank, shuffle=False)
    eval_loader = DataLoader(eval_ds, batch_size=64, sampler=eval_sampler, num_workers=args.workers)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(SigNetF(len(dev))).to(device)
    model = DDP(model, device_ids=[rank], find_unused_parameters=False)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=0.9, nesterov=True,
                          weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.1)

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location={"cuda:0": f"cuda:{rank}"})
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start = ck["epoch"] + 1

    for epoch in range(start, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        agg = torch.zeros(3, device=device)
        for x, cls, forged in loader:
            x, cls, forged = x.to(device, non_blocking=True), cls.to(device), forged.to(device).float()
            _, signer_logits, forg_logit = model(x)
            genuine = forged == 0
            # signer loss only on genuine samples; forgery loss on all of them
            l_signer = F.cross_entropy(signer_logits, cls, reduction="none")
            l_signer = (l_signer * genuine).sum() / genuine.sum().clamp(min=1)
            l_forg = F.binary_cross_entropy_with_logits(forg_logit, forged)
            loss = args.lam * l_signer + (1 - args.lam) * l_forg
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            agg += torch.stack([loss.detach(), (signer_logits.argmax(1) == cls)[genuine].float().mean(),
                                torch.ones((), device=device)])
        sched.step()
        dist.all_reduce(agg)

        # features for all test-signer images, then verification EER on rank 0
        model.eval()
        local = {}
        with torch.no_grad():
            for x, idx in eval_loader:
                f, _, _ = model.module(x.to(device))
                for i, v in zip(idx.tolist(), f.cpu()):
                    local[eval_paths[i]] = v
        parts = [None] * world_size
        dist.all_gather_object(parts, local)
        if rank == 0:
            feats = {}
            for part in parts:
                feats.update(part)
            eer = verification_eer(feats, table, test, args.n_ref)
            print(f"epoch {epoch}: loss {(agg[0] / agg[2]).item():.4f} signer acc {(agg[1] / agg[2]).item():.3f} "
                  f"test EER {eer * 100:.2f}%", flush=True)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "eer": eer}, os.path.join(args.out, f"epoch{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
