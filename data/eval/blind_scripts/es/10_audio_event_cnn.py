"""Environmental sound classification on log-mel spectrograms (CNN14-style net).

metadata.csv: filename,label  with clips under --audio-dir

    accelerate launch --multi_gpu --num_processes 4 10_audio_event_cnn.py \
        --audio-dir /data/urban_sounds/clips --metadata /data/urban_sounds/metadata.csv
"""
import argparse
import json
import os

import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset, random_split

SAMPLE_RATE = 32000
CLIP_SECONDS = 5


class ClipDataset(Dataset):
    def __init__(self, audio_dir, metadata, classes, train=True):
        self.audio_dir = audio_dir
        self.meta = metadata.reset_index(drop=True)
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.train = train
        self.num_samples = SAMPLE_RATE * CLIP_SECONDS
        self.melspec = torchaudio.transforms.MelSpectrogram(
            sample_rate=SAMPLE_RATE, n_fft=1024, hop_length=320, n_mels=64, f_min=50, f_max=14000
        )
        self.to_db = torchaudio.transforms.AmplitudeToDB(top_db=80)
        self.freq_mask = torchaudio.transforms.FrequencyMasking(freq_mask_param=8)
        self.time_mask = torchaudio.transforms.TimeMasking(time_mask_param=40)

    def __len__(self):
        return len(self.meta)

    def _load(self, path):
        wav, sr = torchaudio.load(path)
        wav = wav.mean(dim=0, keepdim=True)
        if sr != SAMPLE_RATE:
            wav = torchaudio.functional.resample(wav, sr, SAMPLE_RATE)
        if wav.size(1) < self.num_samples:
            wav = F.pad(wav, (0, self.num_samples - wav.size(1)))
        elif self.train:
            start = torch.randint(0, wav.size(1) - self.num_samples + 1, (1,)).item()
            wav = wav[:, start:start + self.num_samples]
        else:
            wav = wav[:, : self.num_samples]
        return wav

    def __getitem__(self, idx):
        row = self.meta.iloc[idx]
        spec = self.to_db(self.melspec(self._load(os.path.join(self.audio_dir, row["filename"]))))
        if self.train:
            spec = self.time_mask(self.freq_mask(spec))
        return spec, self.class_to_idx[row["label"]]


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.AvgPool2d(2),
    )


class AudioCNN(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(1)
        self.features = nn.Sequential(conv_block(1, 64), conv_block(64, 128), conv_block(128, 256),
                                      conv_block(256, 512))
        self.dropout = nn.Dropout(0.3)
        self.fc = nn.Linear(512, n_classes)

    def forward(self, x):
        x = self.features(self.bn0(x))
        x = x.mean(dim=3)                 # over time
        x = x.max(dim=2).values            # over frequency
        return self.fc(self.dropout(x))


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--audio-dir", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--num-workers", type=int, default=8)
    ap.add_argument("--out-dir", default="runs/audio_cnn")
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def main():
    args = get_args()
    accelerator = Accelerator(mixed_precision="fp16")
    # per-process seed so that crops and spec-augment masks differ between GPUs
    set_seed(args.seed, device_specific=True)

    meta = pd.read_csv(args.metadata)
    classes = sorted(meta["label"].unique().tolist())
    full = ClipDataset(args.audio_dir, meta, classes, train=True)
    n_val = int(len(full) * args.val_fraction)
    train_subset, val_subset = random_split(full, [len(full) - n_val, n_val])
    val_ds = ClipDataset(args.audio_dir, meta.iloc[val_subset.indices], classes, train=False)
    accelerator.print(f"{len(classes)} classes, train {len(train_subset)}, val {len(val_ds)}")

    train_loader = DataLoader(train_subset, batch_size=args.batch_size, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, num_workers=args.num_workers)

    model = AudioCNN(len(classes))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=20)

    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    accelerator.register_for_checkpointing(scheduler)

    if accelerator.is_main_process:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "classes.json"), "w") as f:
            json.dump(classes, f)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        loss_sum = torch.zeros(2, device=accelerator.device)
        for specs, labels in train_loader:
            logits = model(specs)
            loss = F.cross_entropy(logits, labels, label_smoothing=0.05)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * labels.size(0),
                                     torch.tensor(labels.size(0), device=accelerator.device, dtype=torch.float)])
        scheduler.step()
        loss_sum = accelerator.reduce(loss_sum, reduction="sum")

        model.eval()
        hits, count = 0, 0
        with torch.no_grad():
            for specs, labels in val_loader:
                preds = model(specs).argmax(dim=-1)
                preds, labels = accelerator.gather_for_metrics((preds, labels))
                hits += (preds == labels).sum().item()
                count += labels.numel()
        acc = hits / count
        accelerator.print(f"epoch {epoch:3d} loss {(loss_sum[0] / loss_sum[1]).item():.4f} "
                          f"val_acc {acc:.4f} lr {scheduler.get_last_lr()[0]:.2e}")

        accelerator.save_state(os.path.join(args.out_dir, "last_state"))
        if acc > best:
            best = acc
            accelerator.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out_dir, "best.pt"))

    accelerator.print(f"best val acc {best:.4f}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
