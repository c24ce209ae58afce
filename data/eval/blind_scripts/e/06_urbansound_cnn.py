"""UrbanSound8K environmental sound classification (10 classes), log-mel CNN.

Folds 1-9 train, fold 10 validation.

torchrun --nproc_per_node=4 06_urbansound_cnn.py --root /data/UrbanSound8K --epochs 60
"""
import argparse
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

SR = 22050
CLIP_SAMPLES = SR * 4


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/UrbanSound8K")
    p.add_argument("--val_fold", type=int, default=10)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--bs", type=int, default=32, help="per-GPU batch")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate at 4 GPUs x 32")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--ckpt_dir", default="ckpt_us8k")
    return p.parse_args()


class UrbanSound(Dataset):
    def __init__(self, root, folds, train):
        meta = pd.read_csv(os.path.join(root, "metadata", "UrbanSound8K.csv"))
        self.meta = meta[meta.fold.isin(folds)].reset_index(drop=True)
        self.root = root
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=512, n_mels=64)
        self.db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(8)
        self.time_mask = torchaudio.transforms.TimeMasking(16)

    def __len__(self):
        return len(self.meta)

    def __getitem__(self, i):
        row = self.meta.iloc[i]
        path = os.path.join(self.root, "audio", f"fold{row.fold}", row.slice_file_name)
        wav, sr = torchaudio.load(path)
        wav = wav.mean(0, keepdim=True)
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        if wav.shape[1] < CLIP_SAMPLES:
            wav = F.pad(wav, (0, CLIP_SAMPLES - wav.shape[1]))
        else:
            start = torch.randint(0, wav.shape[1] - CLIP_SAMPLES + 1, (1,)).item() if self.train else 0
            wav = wav[:, start:start + CLIP_SAMPLES]
        spec = self.db(self.mel(wav))
        if self.train:
            spec = self.time_mask(self.freq_mask(spec))
        spec = (spec - spec.mean()) / (spec.std() + 1e-6)
        return spec, int(row.classID)


class AudioCNN(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        chans = [1, 32, 64, 128, 256]
        layers = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
                       nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Dropout(0.3), nn.Linear(256, n_classes))

    def forward(self, x):
        x = self.features(x)
        x = x.mean(dim=(2, 3))
        return self.head(x)


@torch.no_grad()
def validate(model, loader, device):
    """Every rank scores its slice of the validation fold; counts are summed across ranks."""
    model.eval()
    stats = torch.zeros(3, device=device)  # loss_sum, correct, n
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1234)

    train_folds = [f for f in range(1, 11) if f != args.val_fold]
    train_set = UrbanSound(args.root, train_folds, train=True)
    val_set = UrbanSound(args.root, [args.val_fold], train=False)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))

    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_shard, batch_size=64, shuffle=False, num_workers=args.workers)

    model = AudioCNN().to(device)
    model = DDP(model, device_ids=[local_rank])
    # lr was tuned for the 4-GPU run; keep it proportional to the global batch
    lr = args.lr * (args.bs * world_size) / 128
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-3)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        bar = tqdm(train_loader, disable=(rank != 0), ncols=100, desc=f"epoch {epoch + 1}/{args.epochs}")
        for x, y in bar:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            bar.set_postfix(loss=loss.item(), lr=scheduler.get_last_lr()[0])

        if rank == 0:
            val_loss, val_acc = validate(model.module, val_loader, device)
            print(f"epoch {epoch + 1}: val_loss={val_loss:.4f} val_acc={val_acc:.4f}")
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "val_acc": val_acc},
                           os.path.join(args.ckpt_dir, "best.pt"))
        dist.barrier()

    if rank == 0:
        print(f"best fold-{args.val_fold} accuracy: {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
