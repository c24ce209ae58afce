"""Speaker verification with a WavLM-Base+ front-end (weighted layer sum) and an
x-vector style back-end trained with AAM-softmax on VoxCeleb1 dev.

    torchrun --nproc_per_node=4 14_wavlm_sv_aam.py --train_list lists/vox1_dev.txt
"""
import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import WavLMModel


def get_parser():
    p = argparse.ArgumentParser(description="WavLM speaker verification")
    p.add_argument("--train_list", default="lists/vox1_dev.txt")
    p.add_argument("--train_root", default="/corpora/voxceleb1/dev/wav")
    p.add_argument("--trials", default="lists/vox1_O_cleaned.txt")
    p.add_argument("--test_root", default="/corpora/voxceleb1/test/wav")
    p.add_argument("--upstream", default="microsoft/wavlm-base-plus")
    p.add_argument("--save_dir", default="exp/wavlm_sv")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--crop_sec", type=float, default=3.0)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr_backend", type=float, default=1e-3)
    p.add_argument("--lr_upstream", type=float, default=2e-5)
    p.add_argument("--margin", type=float, default=0.2)
    p.add_argument("--scale", type=float, default=32.0)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=42)
    return p


class AttentiveStats(nn.Module):
    def __init__(self, d, hidden=128):
        super().__init__()
        self.att = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):                              # (B, T, D)
        w = torch.softmax(self.att(x), dim=1)
        mu = (w * x).sum(1)
        sd = ((w * x * x).sum(1) - mu * mu).clamp(min=1e-6).sqrt()
        return torch.cat([mu, sd], -1)


class WavLMSpeaker(nn.Module):
    def __init__(self, upstream, emb_dim=256):
        super().__init__()
        self.upstream = WavLMModel.from_pretrained(upstream, layerdrop=0.0, mask_time_prob=0.0,
                                                   mask_feature_prob=0.0)
        self.upstream.feature_extractor._freeze_parameters()
        n_layers = self.upstream.config.num_hidden_layers + 1
        d = self.upstream.config.hidden_size
        self.layer_w = nn.Parameter(torch.zeros(n_layers))
        self.tdnn = nn.Sequential(
            nn.Conv1d(d, 512, 5, padding=2), nn.ReLU(), nn.BatchNorm1d(512),
            nn.Conv1d(512, 512, 3, dilation=2, padding=2), nn.ReLU(), nn.BatchNorm1d(512),
            nn.Conv1d(512, 512, 3, dilation=3, padding=3), nn.ReLU(), nn.BatchNorm1d(512),
        )
        self.pool = AttentiveStats(512)
        self.emb = nn.Linear(1024, emb_dim)

    def forward(self, wav):
        hs = self.upstream(wav, output_hidden_states=True).hidden_states
        hs = torch.stack(hs, 0)                            # (L, B, T, D)
        w = torch.softmax(self.layer_w, 0)[:, None, None, None]
        x = (w * hs).sum(0)
        x = self.tdnn(x.transpose(1, 2)).transpose(1, 2)
        return self.emb(self.pool(x))


class AAMLoss(nn.Module):
    def __init__(self, emb_dim, n_cls, m, s):
        super().__init__()
        self.W = nn.Parameter(torch.empty(emb_dim, n_cls))
        nn.init.xavier_normal_(self.W, gain=1)
        self.m, self.s = m, s

    def forward(self, e, y):
        cos = F.normalize(e, dim=1) @ F.normalize(self.W, dim=0)
        cos_m = torch.cos(torch.acos(cos.clamp(-1 + 1e-7, 1 - 1e-7)) + self.m)
        logits = self.s * torch.where(F.one_hot(y, cos.size(1)).bool(), cos_m, cos)
        return F.cross_entropy(logits, y), (logits.argmax(1) == y).float().mean()


class Full(nn.Module):
    def __init__(self, net, loss):
        super().__init__()
        self.net, self.loss = net, loss

    def forward(self, wav, y):
        return self.loss(self.net(wav), y)


class CropSet(Dataset):
    def __init__(self, list_file, root, crop_sec):
        pairs = [l.split() for l in open(list_file)]
        spk = sorted({s for s, _ in pairs})
        self.lab = {s: i for i, s in enumerate(spk)}
        self.items = [(os.path.join(root, p), self.lab[s]) for s, p in pairs]
        self.n = int(crop_sec * 16000)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        wav, _ = torchaudio.load(path)
        wav = wav[0]
        if wav.numel() < self.n:
            wav = F.pad(wav, (0, self.n - wav.numel()))
        off = random.randint(0, wav.numel() - self.n)
        wav = wav[off:off + self.n]
        return (wav - wav.mean()) / (wav.std() + 1e-5), y


@torch.no_grad()
def eval_eer(net, args, rank, world, device):
    net.eval()
    trials = [l.split() for l in open(args.trials)]
    utts = sorted(set(t[1] for t in trials) | set(t[2] for t in trials))
    mine = {}
    for u in utts[rank::world]:
        wav, _ = torchaudio.load(os.path.join(args.test_root, u))
        wav = wav[:, : 16000 * 20].to(device)
        wav = (wav - wav.mean()) / (wav.std() + 1e-5)
        mine[u] = F.normalize(net(wav), dim=1)[0].cpu()
    net.train()
    allp = [None] * world
    dist.all_gather_object(allp, mine)
    if rank != 0:
        return None
    emb = {k: v for d in allp for k, v in d.items()}
    sc = np.array([float(emb[a] @ emb[b]) for _, a, b in trials])
    lb = np.array([int(t[0]) for t in trials])
    ths = np.quantile(sc, np.linspace(0, 1, 2001))
    fa = np.array([(sc[lb == 0] >= t).mean() for t in ths])
    fr = np.array([(sc[lb == 1] < t).mean() for t in ths])
    k = np.argmin(np.abs(fa - fr))
    return 100.0 * (fa[k] + fr[k]) / 2


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    ds = CropSet(args.train_list, args.train_root, args.crop_sec)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                    pin_memory=True, drop_last=True)

    net = WavLMSpeaker(args.upstream)
    full = Full(net, AAMLoss(256, len(ds.lab), args.margin, args.scale))
    full = nn.SyncBatchNorm.convert_sync_batchnorm(full).to(device)
    model = DDP(full, device_ids=[args.local_rank], output_device=args.local_rank)

    up = [p for n, p in full.named_parameters() if n.startswith("net.upstream.") and p.requires_grad]
    rest = [p for n, p in full.named_parameters() if not n.startswith("net.upstream.")]
    opt = torch.optim.AdamW([{"params": up, "lr": args.lr_upstream},
                             {"params": rest, "lr": args.lr_backend}], weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr_upstream, args.lr_backend],
                                                total_steps=args.epochs * len(dl), pct_start=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 100.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for step, (wav, y) in enumerate(dl):
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, acc = model(wav, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} {step}/{len(dl)} loss {loss.item():.3f} acc {acc.item():.3f} "
                      f"{time.time() - tic:.0f}s", flush=True)

        eer = eval_eer(full.net, args, rank, world, device)
        if rank == 0:
            print(f"epoch {epoch} Vox1-O EER {eer:.3f}%", flush=True)
            torch.save({"model": full.state_dict(), "epoch": epoch, "eer": eer},
                       os.path.join(args.save_dir, "last.pt"))
            if eer < best:
                best = eer
                torch.save(full.net.state_dict(), os.path.join(args.save_dir, "best_embedder.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
