"""TENet-12 keyword spotting, launched with torch.multiprocessing on one box.

MFCCs for every split are extracted once into a cache file; rank 0 builds it
while the other ranks wait.  A batch whose loss is non-finite on any rank is
skipped on all ranks.

    python 18_spawn_tenet_cached.py --root /data/speech_commands_v0.02 --gpus 4 --wandb
"""
import argparse
import os
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

KEYWORDS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_cache(root, path):
    mfcc = torchaudio.transforms.MFCC(16000, n_mfcc=40, melkwargs={"n_fft": 480, "hop_length": 160, "n_mels": 40})
    val = set(open(os.path.join(root, "validation_list.txt")).read().split())
    test = set(open(os.path.join(root, "testing_list.txt")).read().split())
    buckets = {"train": ([], []), "val": ([], []), "test": ([], [])}
    for word in sorted(os.listdir(root)):
        wdir = os.path.join(root, word)
        if word.startswith("_") or not os.path.isdir(wdir):
            continue
        label = KEYWORDS.index(word) + 1 if word in KEYWORDS else 0  # 0 = unknown
        for f in sorted(os.listdir(wdir)):
            rel = f"{word}/{f}"
            split = "val" if rel in val else "test" if rel in test else "train"
            wav = torchaudio.load(os.path.join(wdir, f))[0][0, :16000]
            wav = F.pad(wav, (0, 16000 - wav.numel()))
            buckets[split][0].append(mfcc(wav))
            buckets[split][1].append(label)
    cache = {k: (torch.stack(x), torch.tensor(y)) for k, (x, y) in buckets.items()}
    tmp = path + f".tmp{os.getpid()}"
    torch.save(cache, tmp)
    os.replace(tmp, path)


class TBlock(nn.Module):
    def __init__(self, cin, cout, stride, k=9, expand=3):
        super().__init__()
        hid = cin * expand
        self.net = nn.Sequential(
            nn.Conv1d(cin, hid, 1, bias=False), nn.BatchNorm1d(hid), nn.ReLU(),
            nn.Conv1d(hid, hid, k, stride, k // 2, groups=hid, bias=False), nn.BatchNorm1d(hid), nn.ReLU(),
            nn.Conv1d(hid, cout, 1, bias=False), nn.BatchNorm1d(cout))
        self.short = None if (stride == 1 and cin == cout) else nn.Sequential(
            nn.Conv1d(cin, cout, 1, stride, bias=False), nn.BatchNorm1d(cout))

    def forward(self, x):
        return F.relu(self.net(x) + (x if self.short is None else self.short(x)))


class TENet(nn.Module):
    def __init__(self, n_classes, n_mfcc=40, ch=32, n_stages=4, blocks_per_stage=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv1d(n_mfcc, ch, 3, padding=1, bias=False), nn.BatchNorm1d(ch), nn.ReLU())
        layers = []
        for _ in range(n_stages):
            layers += [TBlock(ch, ch, 2)] + [TBlock(ch, ch, 1) for _ in range(blocks_per_stage - 1)]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, x):
        return self.fc(self.body(self.stem(x)).mean(-1))


def worker(rank, world_size, args, port):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)
    random.seed(args.seed + rank)

    cache_path = os.path.join(args.cache_dir, "mfcc40_cache.pt")
    if rank == 0 and not os.path.exists(cache_path):
        os.makedirs(args.cache_dir, exist_ok=True)
        print("building MFCC cache ...", flush=True)
        build_cache(args.root, cache_path)
    dist.barrier()
    cache = torch.load(cache_path)

    train_set = TensorDataset(*cache["train"])
    val_set = TensorDataset(*cache["val"])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=2, drop_last=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), 1000)

    model = DDP(TENet(len(KEYWORDS) + 1).to(device), device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    fmask, tmask = torchaudio.transforms.FrequencyMasking(8), torchaudio.transforms.TimeMasking(20)

    run = None
    if args.wandb and rank == 0:
        import wandb
        run = wandb.init(project="kws-tenet", config={**vars(args), "world_size": world_size})

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skipped = 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = tmask(fmask(x))
            loss = F.cross_entropy(model(x), y)
            bad = torch.tensor(float(not torch.isfinite(loss)), device=device)
            dist.all_reduce(bad)
            if bad.item() > 0:
                skipped += 1
                opt.zero_grad(set_to_none=True)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sched.step()

        net = model.module.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                acc += torch.stack([(net(x).argmax(1) == y).sum().float(),
                                    torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(acc)
        val_acc = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: val acc {val_acc:.4f}, skipped {skipped} batches", flush=True)
            if run is not None:
                run.log({"val/acc": val_acc, "skipped": skipped, "lr": sched.get_last_lr()[0]}, step=epoch)
            torch.save(model.module.state_dict(), os.path.join(args.cache_dir, "tenet12_last.pt"))

    if run is not None:
        run.finish()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--cache-dir", default="cache/tenet")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()
    port = free_port()
    mp.spawn(worker, args=(args.gpus, args, port), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
