"""Keyword spotting on Speech Commands v2 (35 words) with a small ResNet-style CNN.

The TF pipeline was:
    ds = tf.data.Dataset.from_tensor_slices(files).map(load_and_logmel).cache(CACHE).shuffle(...).batch(...)
Here the log-mel features are computed once and cached to a .pt file, then
served from memory by a TensorDataset.

    torchrun --nproc_per_node=4 08_kws_feature_cache.py --root /data/speech_commands_v0.02
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SAMPLE_RATE = 16000


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--cache-dir", default="cache/kws")
    p.add_argument("--n-mels", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256, help="per replica")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--out", default="runs/kws")
    return p.parse_args()


def read_list(root, name):
    with open(os.path.join(root, name)) as f:
        return set(line.strip() for line in f if line.strip())


def split_files(root):
    val, test = read_list(root, "validation_list.txt"), read_list(root, "testing_list.txt")
    words = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("_"))
    splits = {"train": [], "val": [], "test": []}
    for label, w in enumerate(words):
        for fn in sorted(os.listdir(os.path.join(root, w))):
            rel = f"{w}/{fn}"
            key = "val" if rel in val else "test" if rel in test else "train"
            splits[key].append((rel, label))
    return splits, words


def logmel_features(root, items, n_mels):
    melspec = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160, n_mels=n_mels)
    feats = torch.empty(len(items), 1, n_mels, 101)
    labels = torch.empty(len(items), dtype=torch.long)
    for i, (rel, label) in enumerate(items):
        wav, sr = torchaudio.load(os.path.join(root, rel))
        wav = F.pad(wav[:, :SAMPLE_RATE], (0, max(0, SAMPLE_RATE - wav.shape[1])))
        feats[i] = torch.log(melspec(wav) + 1e-6)
        labels[i] = label
    return feats, labels


def cached_split(args, split, items):
    path = os.path.join(args.cache_dir, f"{split}_mel{args.n_mels}.pt")
    if not os.path.exists(path):
        os.makedirs(args.cache_dir, exist_ok=True)
        feats, labels = logmel_features(args.root, items, args.n_mels)
        torch.save({"x": feats, "y": labels}, path)
    blob = torch.load(path, map_location="cpu")
    return TensorDataset(blob["x"], blob["y"])


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class KWSResNet(nn.Module):
    def __init__(self, n_classes, width=64, blocks=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(width) for _ in range(blocks)])
        self.fc = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def spec_augment(x, max_f=8, max_t=20):
    b, _, n_f, n_t = x.shape
    f0 = torch.randint(0, n_f - max_f, (b,), device=x.device)
    t0 = torch.randint(0, n_t - max_t, (b,), device=x.device)
    fw = torch.randint(0, max_f, (b,), device=x.device)
    tw = torch.randint(0, max_t, (b,), device=x.device)
    fr = torch.arange(n_f, device=x.device)[None]
    tr = torch.arange(n_t, device=x.device)[None]
    fmask = (fr >= f0[:, None]) & (fr < (f0 + fw)[:, None])
    tmask = (tr >= t0[:, None]) & (tr < (t0 + tw)[:, None])
    return x.masked_fill(fmask[:, None, :, None] | tmask[:, None, None, :], 0.0)


@torch.no_grad()
def evaluate(model, loader, device, mean, std):
    model.eval()
    s = torch.zeros(3, device=device)
    for x, y in loader:
        x = (x.to(device, non_blocking=True) - mean) / std
        y = y.to(device, non_blocking=True)
        logits = model(x)
        s += torch.stack([F.cross_entropy(logits, y, reduction="sum"), (logits.argmax(1) == y).sum().float(),
                          torch.tensor(float(y.numel()), device=device)])
    dist.all_reduce(s)
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(17)

    splits, words = split_files(args.root)
    train_ds = cached_split(args, "train", splits["train"])
    val_ds = cached_split(args, "val", splits["val"])
    if rank == 0:
        print(f"{len(words)} keywords | train {len(train_ds)} | val {len(val_ds)} | replicas {world}")

    sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1024, pin_memory=True)

    model = DDP(KWSResNet(len(words)).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_dl))
    mean, std = train_ds.tensors[0].mean().item(), train_ds.tensors[0].std().item()

    best = 0.0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, y in train_dl:
            x = (x.to(device, non_blocking=True) - mean) / std
            y = y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(spec_augment(x)), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach() * y.size(0), torch.tensor(float(y.size(0)), device=device)])
        dist.all_reduce(tot)

        val_loss, val_acc = evaluate(model, val_dl, device, mean, std)
        if rank == 0:
            print(f"epoch {epoch + 1:02d} loss {(tot[0] / tot[1]).item():.4f} val_loss {val_loss:.4f} "
                  f"val_acc {val_acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best:
                best = val_acc
                torch.save({"model": model.module.state_dict(), "words": words, "mean": mean, "std": std},
                           os.path.join(args.out, "kws_best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
