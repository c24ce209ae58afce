# Decoder-only music LM over EnCodec-32kHz tokens (delay pattern, 4 codebooks), text-free.
# torchrun --nproc_per_node=8 14_music_codec_lm.py --audio_dir /data/music/clips_30s --bsz 12
import argparse
import glob
import math
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
from transformers import EncodecModel

N_Q, CARD = 4, 2048
SPECIAL = CARD  # delay-pad token id


class ClipTokens(Dataset):
    """Loads an audio clip, crops it, and encodes it to EnCodec codes on the fly."""

    def __init__(self, files, seconds, device, codec_name="facebook/encodec_32khz"):
        self.files, self.seconds = files, seconds
        self.device, self.codec_name = device, codec_name
        self.codec = None
        self.sr = 32000

    def _codec(self):
        if self.codec is None:
            self.codec = EncodecModel.from_pretrained(self.codec_name).to(self.device).eval()
        return self.codec

    def __len__(self):
        return len(self.files)

    @torch.no_grad()
    def __getitem__(self, i):
        wav, sr = torchaudio.load(self.files[i])
        wav = torchaudio.functional.resample(wav.mean(0, keepdim=True), sr, self.sr)
        n = int(self.seconds * self.sr)
        if wav.size(1) > n:
            start = torch.randint(0, wav.size(1) - n + 1, (1,)).item()
            wav = wav[:, start:start + n]
        else:
            wav = F.pad(wav, (0, n - wav.size(1)))
        codes = self._codec().encode(wav.unsqueeze(0).to(self.device)).audio_codes  # (1, 1, K, T)
        return codes[0, 0, :N_Q].cpu()


def apply_delay(codes):
    """(B, K, T) -> (B, K, T + K - 1) MusicGen delay pattern."""
    B, K, T = codes.shape
    out = torch.full((B, K, T + K - 1), SPECIAL, dtype=codes.dtype, device=codes.device)
    for k in range(K):
        out[:, k, k:k + T] = codes[:, k]
    return out


class CodecLM(nn.Module):
    def __init__(self, d=1024, layers=24, heads=16, max_len=2048):
        super().__init__()
        self.emb = nn.ModuleList([nn.Embedding(CARD + 1, d) for _ in range(N_Q)])
        self.pos = nn.Parameter(torch.zeros(1, max_len, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(d)
        self.heads = nn.ModuleList([nn.Linear(d, CARD) for _ in range(N_Q)])
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):  # x: (B, K, S)
        S = x.size(-1)
        h = sum(self.emb[k](x[:, k]) for k in range(N_Q)) + self.pos[:, :S]
        mask = nn.Transformer.generate_square_subsequent_mask(S, device=x.device)
        h = self.norm(self.tf(h, mask=mask, is_causal=True))
        return torch.stack([head(h) for head in self.heads], 1)  # (B, K, S, CARD)


def lm_loss(logits, target):
    valid = target != SPECIAL
    return F.cross_entropy(logits[valid].float(), target[valid])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--audio_dir", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--bsz", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="ckpt/music_lm")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    files = sorted(glob.glob(os.path.join(args.audio_dir, "**/*.wav"), recursive=True))
    ds = ClipTokens(files, args.seconds, device)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bsz, sampler=sampler, num_workers=args.workers,
                    pin_memory=True, drop_last=True, persistent_workers=True, prefetch_factor=4)

    model = DDP(CodecLM().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 4000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(files)} clips, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params", flush=True)

    step, epoch, t0 = 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for codes in dl:
            codes = apply_delay(codes.to(device, non_blocking=True))
            inp, tgt = codes[..., :-1], codes[..., 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = lm_loss(logits, tgt)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} ep {epoch} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
                t0 = time.time()
            if step % 10000 == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                           os.path.join(args.out, f"lm_{step:07d}.pt"))
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
