"""
Keyword spotting on Speech Commands v2 (35 words) with a small ResNet over
log-mel features. The features are computed once and cached to disk because
decoding 100k wav files every epoch made the GPUs wait.

    torchrun --nproc_per_node=4 15_speech_commands_cached.py --root /data/speech_commands
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
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn left marvin "
                "nine no off on one right seven sheila six stop three tree two up visual wow yes zero".split())


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/speech_commands")
    ap.add_argument("--cache_dir", default="/data/speech_commands/cache")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch_size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="for one GPU; scaled linearly")
    ap.add_argument("--out", default="runs/kws_resnet")
    return ap.parse_args()


class SubsetSC(torchaudio.datasets.SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False)
        def load_list(name):
            with open(os.path.join(self._path, name)) as f:
                return {os.path.normpath(os.path.join(self._path, l.strip())) for l in f}
        if subset == "validation":
            self._walker = [w for w in self._walker if os.path.normpath(w) in load_list("validation_list.txt")]
        elif subset == "testing":
            self._walker = [w for w in self._walker if os.path.normpath(w) in load_list("testing_list.txt")]
        else:
            excl = load_list("validation_list.txt") | load_list("testing_list.txt")
            self._walker = [w for w in self._walker if os.path.normpath(w) not in excl]


def compute_features(ds, show):
    mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=40)
    feats, labels = [], []
    for wav, sr, label, *_ in tqdm(ds, disable=not show, desc="log-mel"):
        wav = F.pad(wav, (0, 16000 - wav.shape[-1]))[:, :16000]
        feats.append(torch.log(mel(wav) + 1e-6))
        labels.append(LABELS.index(label))
    return torch.stack(feats), torch.tensor(labels)


def cached_split(root, cache_dir, subset, rank):
    path = os.path.join(cache_dir, f"{subset}_logmel40.pt")
    if not os.path.exists(path):
        feats, labels = compute_features(SubsetSC(root, subset), show=(rank == 0))
        os.makedirs(cache_dir, exist_ok=True)
        torch.save({"feats": feats, "labels": labels}, path)
    blob = torch.load(path)
    return TensorDataset(blob["feats"], blob["labels"])


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.n1 = nn.GroupNorm(4, c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.n2 = nn.GroupNorm(4, c)

    def forward(self, x):
        return F.relu(x + self.n2(self.c2(F.relu(self.n1(self.c1(x))))))


class KWSResNet(nn.Module):
    def __init__(self, n_classes=35, c=64, n_blocks=6):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.GroupNorm(4, c), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(n_blocks)])
        self.fc = nn.Linear(c, n_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def spec_augment(x):
    # x: (B, 1, 40, 101); one frequency and one time mask per example
    B = x.shape[0]
    f0 = torch.randint(0, 32, (B,), device=x.device)
    t0 = torch.randint(0, 81, (B,), device=x.device)
    fr = torch.arange(40, device=x.device).view(1, -1, 1)
    tr = torch.arange(x.shape[-1], device=x.device).view(1, 1, -1)
    mask = ((fr >= f0.view(-1, 1, 1)) & (fr < f0.view(-1, 1, 1) + 8)) | \
           ((tr >= t0.view(-1, 1, 1)) & (tr < t0.view(-1, 1, 1) + 20))
    return x.masked_fill(mask.unsqueeze(1), 0.0)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = cached_split(args.root, args.cache_dir, "training", rank)
    val_ds = cached_split(args.root, args.cache_dir, "validation", rank)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=512, shuffle=False)

    model = KWSResNet().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * world, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * world, epochs=args.epochs,
                                                    steps_per_epoch=len(train_dl))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = spec_augment(x)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

        if rank == 0:
            model.eval()
            correct = 0
            with torch.no_grad():
                for x, y in val_dl:
                    correct += (model.module(x.to(device)).argmax(1).cpu() == y).sum().item()
            acc = correct / len(val_ds)
            print(f"epoch {epoch}: val acc {acc:.4f} ({time.time() - t0:.0f}s)")
            if acc > best:
                best = acc
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
