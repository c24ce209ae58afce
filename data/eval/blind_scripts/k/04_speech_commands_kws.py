"""Keyword spotting on Google Speech Commands v2 (35 classes), small ResNet on log-mel features.

Runs as a PyTorchJob on Kubernetes; the operator sets MASTER_ADDR/PORT, we start with
    torchrun --nnodes=$NNODES --nproc_per_node=4 --node_rank=$RANK_IDX \
        --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT 04_speech_commands_kws.py
The dataset is pre-downloaded to the shared PVC at /data/speech_commands by an init container.
"""
import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

LOG = logging.getLogger("kws")
SAMPLE_RATE = 16000


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/speech_commands")
    p.add_argument("--cache-dir", default="/data/speech_commands/cache")
    p.add_argument("--ckpt-dir", default="/checkpoints/kws")
    p.add_argument("--n-mels", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    return p.parse_args()


def featurize_split(root: str, subset: str, n_mels: int):
    ds = torchaudio.datasets.SPEECHCOMMANDS(root, subset=subset, download=False)
    labels = sorted({Path(p).parent.name for p in ds._walker})
    label_to_idx = {l: i for i, l in enumerate(labels)}
    mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160, n_mels=n_mels)
    feats, ys = [], []
    for wav, sr, label, *_ in ds:
        wav = F.pad(wav, (0, SAMPLE_RATE - wav.shape[-1])) if wav.shape[-1] < SAMPLE_RATE else wav[:, :SAMPLE_RATE]
        feats.append(torch.log(mel(wav) + 1e-6))
        ys.append(label_to_idx[label])
    return torch.stack(feats), torch.tensor(ys), labels


def load_or_build_features(root: str, cache_dir: str, subset: str, n_mels: int):
    cache = Path(cache_dir) / f"{subset}_logmel{n_mels}.pt"
    if cache.exists():
        blob = torch.load(cache, map_location="cpu")
        return blob["x"], blob["y"], blob["labels"]
    cache.parent.mkdir(parents=True, exist_ok=True)
    x, y, labels = featurize_split(root, subset, n_mels)
    torch.save({"x": x, "y": y, "labels": labels}, cache)
    return x, y, labels


class ResBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class KWSResNet(nn.Module):
    def __init__(self, n_classes: int, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(ResBlock(width, width, 1), ResBlock(width, 2 * width, 2),
                                    ResBlock(2 * width, 2 * width, 1), ResBlock(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, n_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def spec_augment(x, max_t=20, max_f=8):
    b, _, f, t = x.shape
    t0 = torch.randint(0, t - max_t, (b,), device=x.device)
    f0 = torch.randint(0, f - max_f, (b,), device=x.device)
    tt = torch.arange(t, device=x.device)[None, :]
    ff = torch.arange(f, device=x.device)[None, :]
    tmask = (tt >= t0[:, None]) & (tt < t0[:, None] + max_t)
    fmask = (ff >= f0[:, None]) & (ff < f0[:, None] + max_f)
    return x.masked_fill(tmask[:, None, None, :] | fmask[:, None, :, None], 0.0)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # correct, count, loss_sum
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        stats[0] += (logits.argmax(-1) == y).sum()
        stats[1] += y.numel()
        stats[2] += F.cross_entropy(logits, y, reduction="sum")
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item(), (stats[2] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    x_tr, y_tr, labels = load_or_build_features(args.data_root, args.cache_dir, "training", args.n_mels)
    x_va, y_va, _ = load_or_build_features(args.data_root, args.cache_dir, "validation", args.n_mels)
    train_ds, valid_ds = TensorDataset(x_tr, y_tr), TensorDataset(x_va, y_va)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=2, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=512, sampler=DistributedSampler(valid_ds, shuffle=False),
                              num_workers=2, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(KWSResNet(len(labels))).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-3, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(spec_augment(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc, vloss = evaluate(model, valid_loader, device)
        LOG.info("epoch %d val_acc %.4f val_loss %.4f (%.0fs)", epoch, acc, vloss, time.time() - t0)
        if rank == 0 and acc > best:
            best = acc
            os.makedirs(args.ckpt_dir, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "labels": labels, "epoch": epoch, "acc": acc},
                       os.path.join(args.ckpt_dir, "best.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
