"""
Self-supervised audio embeddings (SimCLR on log-mels, two random crops per clip).

    torchrun --nproc_per_node=8 15_audio_simclr_pretrain.py --data /data/audioset_unbal_wav --bsz 256
"""
import argparse
import glob
import os
import random
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SR = 16000


class TwoCrops(Dataset):
    def __init__(self, root, crop_s=2.0):
        self.files = sorted(glob.glob(os.path.join(root, "**/*.wav"), recursive=True))
        self.n = int(crop_s * SR)
        self.mel = torchaudio.transforms.MelSpectrogram(SR, n_fft=1024, hop_length=160, n_mels=64)

    def __len__(self):
        return len(self.files)

    def _crop(self, wav):
        if wav.size(-1) <= self.n:
            return F.pad(wav, (0, self.n - wav.size(-1)))
        s = random.randint(0, wav.size(-1) - self.n)
        return wav[..., s:s + self.n]

    def _view(self, wav):
        x = self._crop(wav) * (10 ** (random.uniform(-6, 6) / 20))
        x = x + 0.005 * random.random() * torch.randn_like(x)
        return (self.mel(x) + 1e-6).log()

    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        wav = wav.mean(0)
        if sr != SR:
            wav = torchaudio.functional.resample(wav, sr, SR)
        return self._view(wav).unsqueeze(0), self._view(wav).unsqueeze(0)


def conv_bn(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class AudioEncoder(nn.Module):
    def __init__(self, width=64, emb=512, proj=128):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            conv_bn(1, w, 1), conv_bn(w, w, 2),
            conv_bn(w, 2 * w, 1), conv_bn(2 * w, 2 * w, 2),
            conv_bn(2 * w, 4 * w, 1), conv_bn(4 * w, 4 * w, 2),
            conv_bn(4 * w, 8 * w, 1), conv_bn(8 * w, emb, 2),
        )
        self.projector = nn.Sequential(nn.Linear(emb, emb, bias=False), nn.BatchNorm1d(emb), nn.ReLU(inplace=True),
                                       nn.Linear(emb, proj))

    def embed(self, x):
        h = self.features(x)
        return h.mean(-1).amax(-1)  # mean over time, max over freq

    def forward(self, x):
        return self.projector(self.embed(x))


def nt_xent(z1, z2, tau):
    z1, z2 = F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)
    rank = dist.get_rank()
    g1 = torch.cat(dfn.all_gather(z1))
    g2 = torch.cat(dfn.all_gather(z2))
    B = z1.size(0)
    labels = torch.arange(B, device=z1.device) + rank * B
    big = torch.cat([g1, g2])                      # (2N, d)
    N = g1.size(0)
    logits1 = z1 @ big.T / tau                     # anchors: view 1
    logits2 = z2 @ big.T / tau                     # anchors: view 2
    self_mask1 = F.one_hot(labels, 2 * N).bool()
    self_mask2 = F.one_hot(labels + N, 2 * N).bool()
    logits1 = logits1.masked_fill(self_mask1, float("-inf"))
    logits2 = logits2.masked_fill(self_mask2, float("-inf"))
    return 0.5 * (F.cross_entropy(logits1, labels + N) + F.cross_entropy(logits2, labels))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--bsz", type=int, default=256, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--tau", type=float, default=0.1)
    ap.add_argument("--out", default="ckpt/audio_simclr")
    ap.add_argument("--wandb", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    use_wandb = args.wandb and rank == 0
    if use_wandb:
        import wandb
        wandb.init(project="audio-ssl", config=vars(args))

    ds = TwoCrops(args.data)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bsz, sampler=sampler, num_workers=10, pin_memory=True,
                    drop_last=True, persistent_workers=True)

    model = AudioEncoder().to(dev).to(memory_format=torch.channels_last)
    model = DDP(model, device_ids=[local_rank])
    base_lr = args.lr * args.bsz * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=base_lr, total_steps=len(dl) * args.epochs,
                                                pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot, n, t0 = torch.zeros((), device=dev), 0, time.time()
        for v1, v2 in dl:
            v1 = v1.to(dev, non_blocking=True).to(memory_format=torch.channels_last)
            v2 = v2.to(dev, non_blocking=True).to(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.float16):
                z1 = model(v1)
                z2 = model(v2)
            loss = nt_xent(z1.float(), z2.float(), args.tau)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            tot += loss.detach()
            n += 1

        dist.all_reduce(tot)
        if rank == 0:
            avg = tot.item() / (n * world)
            print(f"epoch {epoch} loss {avg:.4f} ({time.time() - t0:.0f}s)", flush=True)
            if use_wandb:
                wandb.log({"loss": avg, "lr": sched.get_last_lr()[0], "epoch": epoch})
            if (epoch + 1) % 10 == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"ep{epoch + 1:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
