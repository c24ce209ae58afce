"""Multi-task audio encoder: keyword spotting, speaker ID and emotion recognition.

Three corpora (Speech Commands v2, VoxCeleb1 identification split, CREMA-D),
one transformer encoder over log-mel frames, three heads. Task weights are
learned with GradNorm.

    torchrun --nnodes=1 --nproc_per_node=4 audio_mtl.py --manifest_dir manifests/ --out exp/audio_mtl
"""
import argparse
import csv
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR = 16000
TASKS = [("kws", 35, 1.0), ("spk", 1251, 3.0), ("emo", 6, 3.0)]  # name, classes, clip seconds


class ManifestDataset(Dataset):
    """csv manifest with columns: path,label"""

    def __init__(self, manifest, seconds, train):
        with open(manifest) as f:
            self.rows = [(r["path"], int(r["label"])) for r in csv.DictReader(f)]
        self.n = int(seconds * SR)
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, label = self.rows[i]
        wav, sr = torchaudio.load(path)
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        wav = wav.mean(0)
        if wav.numel() >= self.n:
            start = random.randint(0, wav.numel() - self.n) if self.train else (wav.numel() - self.n) // 2
            wav = wav[start:start + self.n]
        else:
            wav = F.pad(wav, (0, self.n - wav.numel()))
        feats = (self.mel(wav) + 1e-6).log().transpose(0, 1)  # T x 80
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        return feats, label


class AudioEncoder(nn.Module):
    def __init__(self, dim=384, layers=8, heads=6):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv1d(80, dim, 5, stride=2, padding=2), nn.GELU(),
                                       nn.Conv1d(dim, dim, 5, stride=2, padding=2), nn.GELU())
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        x = self.subsample(x.transpose(1, 2)).transpose(1, 2)
        x = self.norm(self.encoder(x))
        return self.proj(x.mean(1))


class AudioMTL(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = AudioEncoder()
        self.heads = nn.ModuleList([nn.Sequential(nn.GELU(), nn.Linear(384, n)) for _, n, _ in TASKS])

    def get_last_shared_layer(self):
        return self.backbone.proj

    def forward(self, feats_per_task):
        return [head(self.backbone(x)) for head, x in zip(self.heads, feats_per_task)]


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for b in loader:
            yield b
        epoch += 1


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(args.seed)

        self.streams, self.val_loaders = [], []
        for name, _, secs in TASKS:
            tr = ManifestDataset(os.path.join(args.manifest_dir, f"{name}_train.csv"), secs, True)
            va = ManifestDataset(os.path.join(args.manifest_dir, f"{name}_test.csv"), secs, False)
            s = DistributedSampler(tr, shuffle=True, seed=args.seed, drop_last=True)
            dl = DataLoader(tr, batch_size=args.batch_size, sampler=s, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
            self.streams.append(infinite(dl, s))
            vs = torch.utils.data.Subset(va, range(self.rank, len(va), self.world))
            self.val_loaders.append(DataLoader(vs, batch_size=64, num_workers=args.workers))

        self.model = DDP(AudioMTL().to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.05)
        warm = args.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
        self.task_weights = torch.ones(len(TASKS), device=self.device, requires_grad=True)
        self.w_opt = torch.optim.Adam([self.task_weights], lr=args.gradnorm_lr)
        self.l0 = None

    def gradnorm_step(self, losses):
        shared = self.model.get_last_shared_layer()
        grads = [torch.autograd.grad(losses[i], shared.weight, retain_graph=True)[0] for i in range(len(TASKS))]
        gnorm = torch.stack([g.norm() for g in grads]).detach()
        dist.all_reduce(gnorm, op=dist.ReduceOp.AVG)

        cur = losses.detach().clone()
        dist.all_reduce(cur, op=dist.ReduceOp.AVG)
        if self.l0 is None:
            self.l0 = cur.clone()
        inv_rate = cur / self.l0
        inv_rate = inv_rate / inv_rate.mean()

        G = self.task_weights * gnorm
        target = (G.mean() * inv_rate ** self.args.alpha).detach()
        gn_loss = F.l1_loss(G, target, reduction="sum")
        self.w_opt.zero_grad(set_to_none=True)
        self.task_weights.grad = torch.autograd.grad(gn_loss, self.task_weights)[0]
        return gnorm, cur

    def train(self):
        a = self.args
        self.model.train()
        for step in range(1, a.steps + 1):
            batches = [next(s) for s in self.streams]
            feats = [b[0].to(self.device, non_blocking=True) for b in batches]
            labels = [b[1].to(self.device, non_blocking=True) for b in batches]
            logits = self.model(feats)
            losses = torch.stack([F.cross_entropy(lg, y, label_smoothing=0.1) for lg, y in zip(logits, labels)])

            gnorm, cur = self.gradnorm_step(losses)
            self.opt.zero_grad(set_to_none=True)
            (self.task_weights.detach() * losses).sum().backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            self.w_opt.step()
            self.sched.step()
            with torch.no_grad():
                self.task_weights.clamp_(min=0.05)
                self.task_weights.mul_(len(TASKS) / self.task_weights.sum())

            if self.rank == 0 and step % 100 == 0:
                msg = " ".join(f"{n}: loss={l:.3f} w={w:.3f} g={g:.3f}" for (n, _, _), l, w, g in
                               zip(TASKS, cur.tolist(), self.task_weights.tolist(), gnorm.tolist()))
                print(f"step {step} {msg}", flush=True)
            if step % a.eval_every == 0 or step == a.steps:
                self.evaluate(step)

    @torch.no_grad()
    def evaluate(self, step):
        net = self.model.module
        net.eval()
        counts = torch.zeros(len(TASKS), 2, device=self.device)
        for i, loader in enumerate(self.val_loaders):
            for x, y in loader:
                x, y = x.to(self.device), y.to(self.device)
                counts[i, 0] += (net.heads[i](net.backbone(x)).argmax(-1) == y).sum()
                counts[i, 1] += y.numel()
        dist.all_reduce(counts)
        acc = (counts[:, 0] / counts[:, 1]).tolist()
        if self.rank == 0:
            print(f"[eval {step}] " + " ".join(f"{n}={v:.4f}" for (n, _, _), v in zip(TASKS, acc)), flush=True)
            os.makedirs(self.args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "task_weights": self.task_weights.detach().cpu(),
                        "opt": self.opt.state_dict(), "step": step}, os.path.join(self.args.out, "last.pt"))
        dist.barrier()
        net.train()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest_dir", required=True)
    ap.add_argument("--out", default="exp/audio_mtl")
    ap.add_argument("--batch_size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--gradnorm_lr", type=float, default=0.01)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=60000)
    ap.add_argument("--warmup_steps", type=int, default=2000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    trainer = Trainer(args)
    trainer.train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
