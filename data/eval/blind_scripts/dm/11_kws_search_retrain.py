"""Random search for a keyword-spotting CNN on Speech Commands v2, then a long
retrain of the best configuration.

Every rank evaluates ``--trials-per-rank`` random configurations on its own GPU
with a short budget.  The leaderboard is gathered on all ranks; the winner is
retrained on train+validation for the full budget and tested.

    torchrun --nproc_per_node=8 kws_search.py --root /data/speech_commands
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import ConcatDataset, DataLoader

LABELS = ["yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go",
          "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
          "bed", "bird", "cat", "dog", "happy", "house", "marvin", "sheila", "tree", "wow",
          "backward", "forward", "follow", "learn", "visual"]
L2I = {l: i for i, l in enumerate(LABELS)}


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/speech_commands")
    ap.add_argument("--out", default="runs/kws_search")
    ap.add_argument("--trials-per-rank", type=int, default=4)
    ap.add_argument("--search-epochs", type=int, default=6)
    ap.add_argument("--final-epochs", type=int, default=120)
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


class SC(torchaudio.datasets.SPEECHCOMMANDS):
    def __init__(self, root, subset):
        super().__init__(root, download=False, subset=subset)


def collate(batch):
    wavs, ys = [], []
    for wav, sr, label, *_ in batch:
        wav = F.pad(wav, (0, 16000 - wav.shape[-1])) if wav.shape[-1] < 16000 else wav[..., :16000]
        wavs.append(wav)
        ys.append(L2I[label])
    return torch.stack(wavs), torch.tensor(ys)


class KWSNet(nn.Module):
    def __init__(self, n_mels, channels, n_blocks, dropout):
        super().__init__()
        self.melspec = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160,
                                                            n_mels=n_mels)
        self.db = torchaudio.transforms.AmplitudeToDB()
        layers, c = [], 1
        for i in range(n_blocks):
            layers += [nn.Conv2d(c, channels, 3, padding=1), nn.BatchNorm2d(channels),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2) if i % 2 == 0 else nn.Identity()]
            c = channels
        self.conv = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(channels, len(LABELS)))

    def forward(self, wav):
        x = self.db(self.melspec(wav) + 1e-6)
        return self.head(self.conv(x))


def sample_config(rng):
    return {"lr": 10 ** rng.uniform(-3.5, -2), "weight_decay": 10 ** rng.uniform(-5, -2),
            "n_mels": rng.choice([40, 64, 80]), "channels": rng.choice([64, 96, 128]),
            "n_blocks": rng.randint(4, 8), "dropout": rng.uniform(0.0, 0.4),
            "batch_size": rng.choice([64, 128, 256])}


def fit(cfg, train_ds, epochs, device, val_ds=None, log_prefix=""):
    torch.manual_seed(0)
    model = KWSNet(cfg["n_mels"], cfg["channels"], cfg["n_blocks"], cfg["dropout"]).to(device)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], shuffle=True, num_workers=8,
                        collate_fn=collate, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"],
                                                total_steps=epochs * len(loader))
    for ep in range(epochs):
        model.train()
        t0 = time.time()
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(wav), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if log_prefix:
            print(f"{log_prefix} epoch {ep} loss {loss.item():.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
    acc = accuracy(model, val_ds, device) if val_ds is not None else None
    return model, acc


@torch.no_grad()
def accuracy(model, ds, device):
    model.eval()
    loader = DataLoader(ds, batch_size=512, num_workers=8, collate_fn=collate)
    hit = n = 0
    for wav, y in loader:
        pred = model(wav.to(device)).argmax(1).cpu()
        hit += (pred == y).sum().item()
        n += len(y)
    return hit / n


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds, val_ds, test_ds = SC(args.root, "training"), SC(args.root, "validation"), SC(args.root, "testing")

    rng = random.Random(args.seed * 10007 + rank)
    results = []
    for t in range(args.trials_per_rank):
        cfg = sample_config(rng)
        t0 = time.time()
        _, acc = fit(cfg, train_ds, args.search_epochs, device, val_ds=val_ds)
        results.append({"rank": rank, "trial": t, "val_acc": acc, "config": cfg,
                        "seconds": time.time() - t0})
        print(f"[rank {rank}] trial {t}: val_acc {acc:.4f} {cfg}", flush=True)

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    board = sorted((r for per_rank in gathered for r in per_rank), key=lambda r: -r["val_acc"])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "leaderboard.json"), "w") as f:
            json.dump(board, f, indent=2)
        best = board[0]
        print(f"best config (val {best['val_acc']:.4f}): {best['config']}", flush=True)

        full_train = ConcatDataset([train_ds, val_ds])
        model, test_acc = fit(best["config"], full_train, args.final_epochs, device,
                              val_ds=test_ds, log_prefix="[final]")
        torch.save({"model": model.state_dict(), "config": best["config"], "test_acc": test_acc},
                   os.path.join(args.out, "final_model.pt"))
        print(f"final test accuracy {test_acc:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
