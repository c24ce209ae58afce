"""Keyword spotting on Google Speech Commands v2 (35 words) with a small conv-net.

Validation every epoch. ReduceLROnPlateau on the validation loss, best checkpoint by
validation accuracy, test accuracy of the best checkpoint at the end.

    torchrun --nproc_per_node=4 05_speech_commands_kws.py --root /data/speech_commands
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

SAMPLE_RATE = 16000


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/speech_commands")
    p.add_argument("--logdir", default="runs/kws")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--plateau-patience", type=int, default=3)
    p.add_argument("--min-lr", type=float, default=1e-5)
    p.add_argument("--workers", type=int, default=6)
    return p.parse_args()


class SpeechCommands(Dataset):
    def __init__(self, root, subset, labels=None):
        self.ds = torchaudio.datasets.SPEECHCOMMANDS(root, subset=subset, download=False)
        if labels is None:
            labels = sorted({os.path.basename(os.path.dirname(p)) for p in self.ds._walker})
        self.labels = labels
        self.label_to_idx = {l: i for i, l in enumerate(labels)}
        self.melspec = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=480, hop_length=160, n_mels=40)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        wav, sr, label, *_ = self.ds[i]
        wav = F.pad(wav, (0, SAMPLE_RATE - wav.shape[-1])) if wav.shape[-1] < SAMPLE_RATE else wav[..., :SAMPLE_RATE]
        feats = (self.melspec(wav) + 1e-6).log()
        return feats, self.label_to_idx[label]


class KWSNet(nn.Module):
    def __init__(self, n_classes, width=64):
        super().__init__()

        def block(cin, cout, stride):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(
            block(1, width, 1), block(width, width, 2),
            block(width, 2 * width, 1), block(2 * width, 2 * width, 2),
            block(2 * width, 4 * width, 1), block(4 * width, 4 * width, 2),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, n_classes)

    def forward(self, x):
        return self.fc(self.pool(self.features(x)).flatten(1))


def run_eval(model, loader, device):
    model.eval()
    total_loss, n_batches = 0.0, 0
    counts = torch.zeros(2, device=device)
    with torch.no_grad():
        for feats, labels in loader:
            feats, labels = feats.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(feats)
            total_loss += F.cross_entropy(logits, labels).item()
            n_batches += 1
            counts[0] += (logits.argmax(1) == labels).sum()
            counts[1] += labels.numel()
    dist.all_reduce(counts)
    model.train()
    return total_loss / max(n_batches, 1), (counts[0] / counts[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = SpeechCommands(args.root, "training")
    val_ds = SpeechCommands(args.root, "validation", labels=train_ds.labels)
    test_ds = SpeechCommands(args.root, "testing", labels=train_ds.labels)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)

    def shard_loader(ds):
        part = torch.utils.data.Subset(ds, range(rank, len(ds), world_size))
        return DataLoader(part, batch_size=512, num_workers=args.workers, pin_memory=True)

    val_loader, test_loader = shard_loader(val_ds), shard_loader(test_ds)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(KWSNet(len(train_ds.labels))).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.3,
                                                         patience=args.plateau_patience, min_lr=args.min_lr)

    writer = SummaryWriter(args.logdir) if rank == 0 else None
    ckpt_path = os.path.join(args.logdir, "best_kws.pt")
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (feats, labels) in enumerate(train_loader):
            feats, labels = feats.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(feats), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if writer is not None and it % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + it)

        val_loss, val_acc = run_eval(model.module, val_loader, device)
        plateau.step(val_loss)

        if rank == 0:
            lr = optimizer.param_groups[0]["lr"]
            writer.add_scalar("val/loss", val_loss, epoch)
            writer.add_scalar("val/acc", val_acc, epoch)
            writer.add_scalar("lr", lr, epoch)
            print(f"epoch {epoch:3d} val_loss {val_loss:.4f} val_acc {val_acc:.4f} lr {lr:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "labels": train_ds.labels,
                            "val_acc": val_acc}, ckpt_path)

    dist.barrier()
    best = torch.load(ckpt_path, map_location=device)
    model.module.load_state_dict(best["model"])
    _, test_acc = run_eval(model.module, test_loader, device)
    if rank == 0:
        print(f"best epoch {best['epoch']} val_acc {best['val_acc']:.4f} test_acc {test_acc:.4f}")
        writer.add_scalar("test/acc", test_acc, best["epoch"])
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
