"""Federated keyword spotting on Speech Commands v2: every speaker is a client.

Speakers have anywhere from 1 to a few hundred utterances. Clients with fewer than
--min-utts are dropped. Features are log-mel spectrograms computed on the GPU.

    torchrun --nnodes=1 --nproc_per_node=8 14_fedavg_speech_commands.py --root /data/speech_commands
"""
import argparse
import os
import time
from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.utils.data import DataLoader, Subset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/speech_commands")
    p.add_argument("--ckpt", default="/shared/kws_fedavg/ckpt")
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--speakers-per-round", type=int, default=64)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--bs", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--min-utts", type=int, default=10)
    p.add_argument("--seed", type=int, default=99)
    p.add_argument("--eval-every", type=int, default=20)
    return p.parse_args()


def pad_collate(batch):
    wavs, labels = [], []
    for wav, sr, label, *_ in batch:
        wav = wav[0, :16000]
        wavs.append(F.pad(wav, (0, 16000 - wav.numel())))
        labels.append(LABEL_TO_IDX[label])
    return torch.stack(wavs), torch.tensor(labels)


class KWSNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.ReLU(),
                                 nn.MaxPool2d(2))
        self.body = nn.Sequential(block(1, 32), block(32, 64), block(64, 128))
        self.fc = nn.Linear(128, n_classes)

    def forward(self, spec):
        x = self.body(spec.unsqueeze(1))
        return self.fc(x.mean(dim=(2, 3)))


class Frontend(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=480, hop_length=160, n_mels=40)

    @torch.no_grad()
    def forward(self, wav):
        return torch.log(self.mel(wav) + 1e-6)


LABEL_TO_IDX = {}


def train_speaker(model, frontend, loader, epochs, lr, device):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        for wav, y in loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(frontend(wav)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


@torch.no_grad()
def test_acc(model, frontend, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for wav, y in loader:
        wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
        c[0] += (model(frontend(wav)).argmax(1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    train_ds = torchaudio.datasets.SPEECHCOMMANDS(args.root, download=False, subset="training")
    test_ds = torchaudio.datasets.SPEECHCOMMANDS(args.root, download=False, subset="testing")
    labels = sorted({os.path.basename(os.path.dirname(p)) for p in train_ds._walker})
    LABEL_TO_IDX.update({l: i for i, l in enumerate(labels)})

    by_speaker = defaultdict(list)
    for i, path in enumerate(train_ds._walker):
        by_speaker[os.path.basename(path).split("_nohash_")[0]].append(i)
    speakers = sorted(s for s, idx in by_speaker.items() if len(idx) >= args.min_utts)
    if rank == 0:
        print(f"{len(speakers)} speakers kept, {len(labels)} keywords", flush=True)

    test_loader = DataLoader(Subset(test_ds, range(rank, len(test_ds), world)), batch_size=256,
                             num_workers=6, collate_fn=pad_collate, pin_memory=True)

    frontend = Frontend().to(dev)
    global_model = KWSNet(len(labels)).to(dev)
    local_model = KWSNet(len(labels)).to(dev)
    for t in global_model.state_dict().values():
        dist.broadcast(t, 0)

    os.makedirs(args.ckpt, exist_ok=True)
    latest = os.path.join(args.ckpt, "latest.pt")
    start = 0
    if os.path.exists(latest):
        state = torch.load(latest, map_location="cpu")
        global_model.load_state_dict(state["model"])
        start = state["round"]

    best = 0.0
    for rnd in range(start, args.rounds):
        t0 = time.time()
        pick = np.random.default_rng(args.seed + rnd).choice(len(speakers), args.speakers_per_round, replace=False)
        agg = [torch.zeros_like(p) for p in global_model.parameters()]
        count = torch.zeros(1, device=dev)
        for j in pick[rank::world]:
            idx = by_speaker[speakers[j]]
            local_model.load_state_dict(global_model.state_dict())
            loader = DataLoader(Subset(train_ds, idx), batch_size=args.bs, shuffle=True, num_workers=2,
                                collate_fn=pad_collate)
            train_speaker(local_model, frontend, loader, args.local_epochs, args.lr, dev)
            for a, p in zip(agg, local_model.parameters()):
                a.add_(p.detach(), alpha=len(idx))
            count += len(idx)

        dist.all_reduce(count)
        for a in agg:
            dist.all_reduce(a)
        with torch.no_grad():
            for p, a in zip(global_model.parameters(), agg):
                p.copy_(a / count)

        if rank == 0 and rnd % 10 == 0:
            print(f"round {rnd} took {time.time() - t0:.1f}s", flush=True)

        if (rnd + 1) % args.eval_every == 0:
            acc = test_acc(global_model, frontend, test_loader, dev)
            # all ranks hold the same global model after the all-reduce
            state = {"model": global_model.state_dict(), "round": rnd + 1, "acc": acc,
                     "labels": labels}
            torch.save(state, latest)
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.ckpt, "best.pt"))
            if rank == 0:
                print(f"[round {rnd + 1}] test acc {acc:.4f} (best {best:.4f})", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
