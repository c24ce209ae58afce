"""Conformer-CTC on LibriSpeech, meant for spot/preemptible node pools.

Each node runs an elastic agent:
    torchrun --nnodes=4 --nproc_per_node=8 --max-restarts=20 \
        --rdzv-backend=c10d --rdzv-endpoint=$RDZV_HOST:29400 --rdzv-id=conformer-ctc \
        05_conformer_ctc_spot.py --ckpt-dir /mnt/gcs/ckpt/conformer_ctc

When the cloud provider announces a preemption the node gets SIGTERM (~30 s
before the hard kill).  We write a checkpoint and leave the loop cleanly so
the agent can re-rendezvous once a replacement node has joined.
"""
import argparse
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}

_preempted = False


def _on_sigterm(signum, frame):
    global _preempted
    _preempted = True
    print(f"[rank {os.environ.get('RANK')}] got signal {signum}, will checkpoint and exit",
          file=sys.stderr, flush=True)


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/mnt/data/librispeech")
    p.add_argument("--ckpt-dir", default="/mnt/gcs/ckpt/conformer_ctc")
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=2000)
    return p.parse_args()


class ConformerCTC(nn.Module):
    def __init__(self, n_mels=80, d=256, layers=16, heads=4, vocab=len(VOCAB)):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d, 3, stride=2), nn.ReLU(),
            nn.Conv2d(d, d, 3, stride=2), nn.ReLU(),
        )
        self.proj = nn.Linear(d * (((n_mels - 1) // 2 - 1) // 2), d)
        self.encoder = torchaudio.models.Conformer(
            input_dim=d, num_heads=heads, ffn_dim=4 * d, num_layers=layers,
            depthwise_conv_kernel_size=31, dropout=0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, feats, lengths):
        x = self.subsample(feats.unsqueeze(1))           # B, d, T', F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        x, lengths = self.encoder(x, lengths.clamp(min=1, max=t))
        return self.head(x).log_softmax(-1), lengths


class Featurizer:
    def __init__(self):
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=80)

    def __call__(self, batch):
        feats, flen, tgts, tlen = [], [], [], []
        for wav, sr, text, *_ in batch:
            m = (self.mel(wav).squeeze(0) + 1e-6).log().transpose(0, 1)
            m = (m - m.mean(0)) / (m.std(0) + 1e-5)
            ids = torch.tensor([CHAR2ID[c] for c in text.lower() if c in CHAR2ID])
            feats.append(m); flen.append(m.size(0)); tgts.append(ids); tlen.append(len(ids))
        return (pad_sequence(feats, batch_first=True), torch.tensor(flen),
                torch.cat(tgts), torch.tensor(tlen))


def save_ckpt(path, model, opt, sched, epoch, step_in_epoch, global_step):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                "sched": sched.state_dict(), "epoch": epoch,
                "step_in_epoch": step_in_epoch, "global_step": global_step}, tmp)
    os.replace(tmp, path)


def main():
    args = args_()
    signal.signal(signal.SIGTERM, _on_sigterm)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if rank == 0:
        print(f"world={world} restart#{restart}", flush=True)
        os.makedirs(args.ckpt_dir, exist_ok=True)
    dist.barrier()

    train_ds = torch.utils.data.ConcatDataset([
        torchaudio.datasets.LIBRISPEECH(args.data, url=u, download=False)
        for u in ("train-clean-100", "train-clean-360", "train-other-500")])
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=8,
                        collate_fn=Featurizer(), pin_memory=True, drop_last=True)

    model = ConformerCTC().to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    ckpt_path = os.path.join(args.ckpt_dir, "latest.pt")
    epoch, skip, global_step = 0, 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        epoch, skip, global_step = ck["epoch"], ck["step_in_epoch"], ck["global_step"]
        if rank == 0:
            print(f"resumed epoch {epoch} step {skip} (global {global_step})", flush=True)

    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (feats, flen, tgts, tlen) in enumerate(loader):
            if i < skip:
                continue
            feats, flen = feats.to(device, non_blocking=True), flen.to(device)
            tgts, tlen = tgts.to(device), tlen.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, olen = model(feats, flen)
            loss = ctc(logp.float().transpose(0, 1), tgts, olen, tlen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            global_step += 1

            if _preempted:
                if rank == 0:
                    save_ckpt(ckpt_path, model, opt, sched, epoch, i + 1, global_step)
                    print(f"preemption checkpoint at global step {global_step}", flush=True)
                dist.barrier()
                dist.destroy_process_group()
                sys.exit(0)

            if global_step % args.ckpt_every == 0:
                if rank == 0:
                    save_ckpt(ckpt_path, model, opt, sched, epoch, i + 1, global_step)
                dist.barrier()
            if rank == 0 and global_step % 100 == 0:
                print(f"ep {epoch} it {i} gstep {global_step} ctc {loss.item():.3f} "
                      f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / max(1, i + 1 - skip):.2f}s/it",
                      flush=True)
        skip = 0
        epoch += 1
        if rank == 0:
            save_ckpt(ckpt_path, model, opt, sched, epoch, 0, global_step)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
