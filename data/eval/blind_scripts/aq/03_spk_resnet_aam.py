"""ResNet34 speaker embedding with AAM-softmax on VoxCeleb2, evaluated on Vox1-O.

torchrun --nproc_per_node=4 03_spk_resnet_aam.py --train_list lists/vox2_train.txt \
    --trials lists/vox1_O_cleaned.txt --wav_root /data/voxceleb
"""
import argparse
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_list", required=True)
    ap.add_argument("--trials", required=True)
    ap.add_argument("--wav_root", required=True)
    ap.add_argument("--save_dir", default="exp/resnet34_aam")
    ap.add_argument("--batch_size", type=int, default=128, help="per GPU")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--margin", type=float, default=0.2)
    ap.add_argument("--scale", type=float, default=32.0)
    ap.add_argument("--seg_sec", type=float, default=2.0)
    ap.add_argument("--emb_dim", type=int, default=256)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=8)
    return ap.parse_args()


class VoxTrain(Dataset):
    def __init__(self, list_file, wav_root, seg_sec):
        self.items = []
        with open(list_file) as f:
            for line in f:
                spk, rel = line.split()
                self.items.append((spk, rel))
        speakers = sorted({s for s, _ in self.items})
        self.spk2id = {s: i for i, s in enumerate(speakers)}
        self.root = wav_root
        self.seg = int(seg_sec * 16000)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        spk, rel = self.items[idx]
        wav, _ = sf.read(os.path.join(self.root, rel), dtype="float32")
        if len(wav) <= self.seg:
            wav = np.pad(wav, (0, self.seg - len(wav) + 1), mode="wrap")
        start = random.randint(0, len(wav) - self.seg)
        return torch.from_numpy(wav[start:start + self.seg].copy()), self.spk2id[spk]


class WavList(Dataset):
    def __init__(self, utts, wav_root):
        self.utts = utts
        self.root = wav_root

    def __len__(self):
        return len(self.utts)

    def __getitem__(self, idx):
        wav, _ = sf.read(os.path.join(self.root, self.utts[idx]), dtype="float32")
        return torch.from_numpy(wav), idx


class Fbank(nn.Module):
    def __init__(self, n_mels=80):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                                        f_min=20, f_max=7600, n_mels=n_mels,
                                                        window_fn=torch.hamming_window)

    @torch.no_grad()
    def forward(self, x):
        x = (self.mel(x) + 1e-6).log()
        return x - x.mean(dim=-1, keepdim=True)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet34SE(nn.Module):
    def __init__(self, emb_dim=256, base=32, n_mels=80):
        super().__init__()
        self.fbank = Fbank(n_mels)
        self.conv1 = nn.Conv2d(1, base, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        layers, cin = [], base
        for i, (n, s) in enumerate(zip([3, 4, 6, 3], [1, 2, 2, 2])):
            cout = base * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, s if j == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        out_f = n_mels // 8
        self.attn = nn.Sequential(nn.Conv1d(cin * out_f, 128, 1), nn.ReLU(), nn.BatchNorm1d(128),
                                  nn.Conv1d(128, cin * out_f, 1), nn.Softmax(dim=2))
        self.fc = nn.Linear(cin * out_f * 2, emb_dim)
        self.bn_out = nn.BatchNorm1d(emb_dim)

    def forward(self, wav):
        x = self.fbank(wav).unsqueeze(1)
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        x = x.flatten(1, 2)
        w = self.attn(x)
        mu = (x * w).sum(2)
        sg = ((x ** 2 * w).sum(2) - mu ** 2).clamp(min=1e-5).sqrt()
        return self.bn_out(self.fc(torch.cat([mu, sg], 1)))


class AAMSoftmax(nn.Module):
    def __init__(self, emb_dim, n_class, m, s):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_class, emb_dim))
        nn.init.xavier_normal_(self.weight)
        self.m, self.s = m, s
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x, label):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = (1.0 - cosine.pow(2)).clamp(0, 1).sqrt()
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where(cosine - self.th > 0, phi, cosine - self.mm)
        one_hot = F.one_hot(label, cosine.size(1)).float()
        logits = self.s * (one_hot * phi + (1.0 - one_hot) * cosine)
        loss = F.cross_entropy(logits, label)
        acc = (cosine.argmax(1) == label).float().mean()
        return loss, acc


class SpeakerNet(nn.Module):
    def __init__(self, n_spk, args):
        super().__init__()
        self.encoder = ResNet34SE(args.emb_dim)
        self.head = AAMSoftmax(args.emb_dim, n_spk, args.margin, args.scale)

    def forward(self, wav, label):
        return self.head(self.encoder(wav), label)


def compute_eer(scores, labels):
    fpr, tpr, _ = roc_curve(labels, scores, pos_label=1)
    fnr = 1 - tpr
    i = np.nanargmin(np.abs(fnr - fpr))
    return (fpr[i] + fnr[i]) / 2 * 100


@torch.no_grad()
def evaluate(encoder, trials_file, wav_root, device, rank, world_size):
    with open(trials_file) as f:
        trials = [l.split() for l in f if l.strip()]
    my_trials = trials[rank::world_size]
    utts = sorted({t[1] for t in my_trials} | {t[2] for t in my_trials})
    loader = DataLoader(WavList(utts, wav_root), batch_size=1, num_workers=4)
    encoder.eval()
    embs = {}
    for wav, idx in loader:
        e = encoder(wav.to(device))
        embs[utts[idx.item()]] = F.normalize(e, dim=1)[0]
    scores = [float(embs[a] @ embs[b]) for _, a, b in my_trials]
    labels = [int(l) for l, _, _ in my_trials]
    encoder.train()
    return compute_eer(np.array(scores), np.array(labels))


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    random.seed(1000 + rank)
    torch.manual_seed(1000)

    train_set = VoxTrain(args.train_list, args.wav_root, args.seg_sec)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    model = SpeakerNet(len(train_set.spk2id), args)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=2e-5, nesterov=True)
    total_steps = args.epochs * len(loader)
    warmup = 6 * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total_steps - warmup))))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(train_set)} utts, {len(train_set.spk2id)} speakers, {len(loader)} steps/epoch")

    best_eer = 100.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(3, device=device)
        for step, (wav, label) in enumerate(loader):
            wav, label = wav.to(device, non_blocking=True), label.to(device, non_blocking=True)
            loss, acc = model(wav, label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            tot += torch.stack([loss.detach(), acc.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch} loss {tot[0] / tot[2]:.4f} acc {100 * tot[1] / tot[2]:.2f}% "
                  f"lr {scheduler.get_last_lr()[0]:.5f}")

        if epoch % args.eval_every == 0 or epoch == args.epochs:
            eer = evaluate(model.module.encoder, args.trials, args.wav_root, device, rank, world_size)
            if rank == 0:
                print(f"epoch {epoch} Vox1-O EER {eer:.3f}%")
                torch.save({"epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict()}, os.path.join(args.save_dir, "last.pt"))
                if eer < best_eer:
                    best_eer = eer
                    torch.save(model.module.encoder.state_dict(), os.path.join(args.save_dir, "best_encoder.pt"))
            dist.barrier()

    if rank == 0:
        print(f"best EER {best_eer:.3f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
