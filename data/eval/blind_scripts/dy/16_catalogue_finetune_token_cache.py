"""Fine-tune our base music LM on a customer catalogue (a few hundred tracks).

The catalogue is small, so we tokenise it once with the 32 kHz EnCodec and keep the
codes in a single cache file next to the data; later runs with other hyper-parameters
reuse it.

    torchrun --nproc_per_node=8 16_catalogue_finetune_token_cache.py \
        --manifest /mnt/nfs/customers/acme/tracks.txt --init /mnt/nfs/models/base_lm_300m.pt \
        --out /mnt/nfs/customers/acme/lm_ft
"""
import argparse
import hashlib
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import EncodecModel

CARD, N_Q = 2048, 4


def load_or_build_token_cache(manifest, codec, device, chunk_seconds=30.0):
    with open(manifest, "rb") as f:
        key = hashlib.sha1(f.read()).hexdigest()[:12]
    cache_path = os.path.join(os.path.dirname(manifest), f"encodec32k_codes_{key}.pt")
    if os.path.exists(cache_path):
        return torch.load(cache_path, map_location="cpu")

    sr = codec.config.sampling_rate
    chunk = int(chunk_seconds * sr)
    tracks = []
    with open(manifest) as f:
        paths = [l.strip() for l in f if l.strip()]
    for path in paths:
        wav, file_sr = torchaudio.load(path)
        wav = torchaudio.functional.resample(wav.mean(0, keepdim=True), file_sr, sr)
        pieces = []
        with torch.no_grad():
            for s in range(0, wav.shape[-1], chunk):
                x = wav[:, s : s + chunk].unsqueeze(0).to(device)
                pieces.append(codec.encode(x, bandwidth=codec.config.target_bandwidths[-1]).audio_codes[0, 0].cpu())
        tracks.append(torch.cat(pieces, -1).to(torch.int16))
    torch.save({"paths": paths, "codes": tracks}, cache_path)
    return {"paths": paths, "codes": tracks}


class Windows(Dataset):
    def __init__(self, tracks, frames, stride):
        self.tracks, self.frames = tracks, frames
        self.index = [(i, s) for i, t in enumerate(tracks) for s in range(0, max(1, t.shape[-1] - frames), stride)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, j):
        i, s = self.index[j]
        s = min(s + random.randint(0, 49), max(0, self.tracks[i].shape[-1] - self.frames))  # jitter up to 1 s
        c = self.tracks[i][:, s : s + self.frames].long()
        return F.pad(c, (0, self.frames - c.shape[-1]), value=CARD)


class LM(nn.Module):
    def __init__(self, dim=1024, layers=24, heads=16, max_len=1600):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(CARD + 1, dim) for _ in range(N_Q))
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, "gelu", batch_first=True, norm_first=True)
        self.tf = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.heads = nn.ModuleList(nn.Linear(dim, CARD) for _ in range(N_Q))

    def forward(self, x):
        t = x.shape[-1]
        h = sum(e(x[:, k]) for k, e in enumerate(self.emb)) + self.pos.weight[:t]
        h = self.tf(h, mask=nn.Transformer.generate_square_subsequent_mask(t, device=x.device), is_causal=True)
        h = self.norm(h)
        return torch.stack([hd(h) for hd in self.heads], 1)


def delayed(codes):
    b, k, t = codes.shape
    out = codes.new_full((b, k, t + k), CARD)
    for q in range(k):
        out[:, q, q + 1 : q + 1 + t] = codes[:, q]
    return out[..., :-1], out[..., 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=4, help="per GPU")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--valid-tracks", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)

    codec = EncodecModel.from_pretrained("facebook/encodec_32khz").to(device).eval()
    cache = load_or_build_token_cache(args.manifest, codec, device)
    del codec
    torch.cuda.empty_cache()

    tracks = cache["codes"]
    valid_tracks, train_tracks = tracks[: args.valid_tracks], tracks[args.valid_tracks :]
    train_ds = Windows(train_tracks, args.frames, stride=args.frames // 2)
    valid_ds = Windows(valid_tracks, args.frames, stride=args.frames)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=4, drop_last=True, pin_memory=True)
    vdl = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), args.batch_size, num_workers=2)

    base = LM()
    base.load_state_dict(torch.load(args.init, map_location="cpu"))
    model = DDP(base.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200) * max(0.0, 1 - s / total))

    best = float("inf")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, codes in enumerate(dl):
            codes = codes.to(device, non_blocking=True)
            inp, tgt = delayed(codes)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(inp)
            loss = F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten(), ignore_index=CARD)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            if i % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} it {i}/{len(dl)} loss {l.item():.4f}", flush=True)

        model.eval()
        acc = torch.zeros(2, device=device)
        with torch.no_grad():
            for codes in vdl:
                codes = codes.to(device)
                inp, tgt = delayed(codes)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model.module(inp)
                acc[0] += F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten(), ignore_index=CARD,
                                          reduction="sum")
                acc[1] += (tgt != CARD).sum()
        dist.all_reduce(acc)
        val = (acc[0] / acc[1]).item()
        if rank == 0:
            print(f"epoch {epoch} valid loss {val:.4f} ppl {math.exp(val):.2f}", flush=True)
            if val < best:
                best = val
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
