"""Keyword spotting on Speech Commands v2 (35 words) with Ray Train.

Runs on the 4-GPU box:  python 05_ray_speechcommands_kws.py --num-workers 4
"""
import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader

import ray
import ray.train
import ray.train.torch
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

LABELS = sorted("backward bed bird cat dog down eight five follow forward four go happy house learn left "
                "marvin nine no off on one right seven sheila six stop three tree two up visual wow yes zero".split())
LABEL2IDX = {l: i for i, l in enumerate(LABELS)}


class KWSSet(torchaudio.datasets.SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False, subset=subset)
        self.featurizer = torch.nn.Sequential(
            torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=40),
            torchaudio.transforms.AmplitudeToDB(),
        )

    def __getitem__(self, n):
        wav, sr, label, *_ = super().__getitem__(n)
        wav = F.pad(wav, (0, 16000 - wav.shape[-1])) if wav.shape[-1] < 16000 else wav[..., :16000]
        return self.featurizer(wav), LABEL2IDX[label]


class DSConvNet(nn.Module):
    """depthwise-separable CNN, ~0.5M params"""

    def __init__(self, n_classes=len(LABELS), width=172):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, (10, 4), stride=(2, 2), padding=(5, 1)),
                                  nn.BatchNorm2d(width), nn.ReLU())
        layers = []
        for _ in range(4):
            layers += [
                nn.Conv2d(width, width, 3, padding=1, groups=width), nn.BatchNorm2d(width), nn.ReLU(),
                nn.Conv2d(width, width, 1), nn.BatchNorm2d(width), nn.ReLU(),
            ]
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(width, n_classes)

    def forward(self, x):
        x = self.body(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


def train_loop_per_worker(config):
    device = ray.train.torch.get_device()
    ctx = ray.train.get_context()

    train_set = KWSSet(config["data_root"], "training")
    val_set = KWSSet(config["data_root"], "validation")
    train_loader = DataLoader(train_set, batch_size=config["batch_size"], shuffle=True,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=4)

    model = ray.train.torch.prepare_model(DSConvNet())
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=1e-3)
    steps = config["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config["lr"], total_steps=steps)
    spec_aug = nn.Sequential(torchaudio.transforms.FrequencyMasking(8),
                             torchaudio.transforms.TimeMasking(20)).to(device)

    start_epoch = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), map_location=device)
        model.module.load_state_dict(state["model"]) if hasattr(model, "module") else model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, config["epochs"]):
        model.train()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = spec_aug(x)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach() * y.numel(), torch.tensor(y.numel(), device=device)])

        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device), y.to(device)
                correct += torch.stack([(model(x).argmax(-1) == y).sum().float(),
                                        torch.tensor(float(y.numel()), device=device)])
        if ctx.get_world_size() > 1:
            torch.distributed.all_reduce(running)
            torch.distributed.all_reduce(correct)
        metrics = {"epoch": epoch, "train_loss": (running[0] / running[1]).item(),
                   "val_acc": (correct[0] / correct[1]).item()}

        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                net = model.module if hasattr(model, "module") else model
                torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch},
                           os.path.join(tmp, "state.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/mnt/datasets/speech_commands")
    ap.add_argument("--num-workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--storage", default="/mnt/ray_results")
    args = ap.parse_args()

    ray.init()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"data_root": args.data_root, "epochs": args.epochs,
                           "batch_size": args.batch_size, "lr": args.lr},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=True,
                                     resources_per_worker={"CPU": 8, "GPU": 1}),
        run_config=RunConfig(name="kws_dscnn", storage_path=args.storage,
                             checkpoint_config=CheckpointConfig(num_to_keep=3,
                                                                checkpoint_score_attribute="val_acc",
                                                                checkpoint_score_order="max")),
    )
    result = trainer.fit()
    print("final metrics:", result.metrics)
    print("best checkpoint:", result.get_best_checkpoint("val_acc", "max"))


if __name__ == "__main__":
    main()
