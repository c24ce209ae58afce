"""Sound-effects LM (AudioGen-like) over 32 kHz EnCodec tokens, conditioned on a tag vocabulary.

Periodically renders a few samples with CFG so we can listen to progress.

    torchrun --nproc_per_node=8 13_sfx_lm_periodic_samples.py --codes /data/sfx/codes32k \
        --tags /data/sfx/tags.json --out /data/exp/sfx_lm
"""
import argparse
import json
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from audiocraft.models import CompressionModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

N_Q, CARD, FRAME_RATE = 4, 2048, 50
SPECIAL = CARD


class SfxCodes(Dataset):
    def __init__(self, root, meta, split, frames):
        self.root, self.frames, self.train = root, frames, split == "train"
        self.items = [m for m in meta["clips"] if m["split"] == split]
        self.n_tags = len(meta["tags"])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        codes = np.load(os.path.join(self.root, it["file"]))
        T = codes.shape[1]
        s = random.randint(0, max(0, T - self.frames)) if self.train else 0
        c = torch.full((N_Q, self.frames), SPECIAL, dtype=torch.long)
        seg = torch.from_numpy(codes[:, s : s + self.frames].astype(np.int64))
        c[:, : seg.shape[1]] = seg
        tags = torch.zeros(self.n_tags)
        tags[it["tags"]] = 1.0
        return c, tags


class SfxLM(nn.Module):
    def __init__(self, n_tags, dim=1024, layers=24, heads=16, max_len=1024):
        super().__init__()
        self.tag_proj = nn.Linear(n_tags, dim)
        self.emb = nn.ModuleList(nn.Embedding(CARD + 1, dim) for _ in range(N_Q))
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, "gelu", batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.ModuleList(nn.Linear(dim, CARD) for _ in range(N_Q))

    def forward(self, tokens, tags):
        x = sum(self.emb[k](tokens[:, k]) for k in range(N_Q))
        x = torch.cat([self.tag_proj(tags)[:, None], x], 1)
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.norm(self.body(x, mask=mask, is_causal=True))[:, 1:]
        return torch.stack([o(h) for o in self.out], 1)

    @torch.no_grad()
    def generate(self, tags, frames, cfg_coef=3.0, top_k=250):
        b = tags.shape[0]
        tokens = torch.full((b, N_Q, 0), SPECIAL, dtype=torch.long, device=tags.device)
        null = torch.zeros_like(tags)
        for t in range(frames + N_Q - 1):
            inp = torch.cat([torch.full((b, N_Q, 1), SPECIAL, device=tags.device), tokens], -1)
            logits = self(torch.cat([inp, inp]), torch.cat([tags, null]))[..., -1, :]
            cond, uncond = logits.chunk(2)
            logits = uncond + cfg_coef * (cond - uncond)
            v, _ = logits.topk(top_k, -1)
            logits[logits < v[..., -1:]] = -float("inf")
            nxt = torch.multinomial(logits.softmax(-1).flatten(0, 1), 1).view(b, N_Q, 1)
            for k in range(N_Q):  # keep the delay pattern: codebook k starts at step k
                if t < k or t - k >= frames:
                    nxt[:, k] = SPECIAL
            tokens = torch.cat([tokens, nxt], -1)
        return torch.stack([tokens[:, k, k : k + frames] for k in range(N_Q)], 1)


def delay(codes):
    b, k, t = codes.shape
    out = codes.new_full((b, k, t + k - 1), SPECIAL)
    for q in range(k):
        out[:, q, q : q + t] = codes[:, q]
    return out


def lm_loss(model, codes, tags):
    tgt = delay(codes)
    inp = torch.cat([torch.full_like(tgt[..., :1], SPECIAL), tgt[..., :-1]], -1)
    logits = model(inp, tags)
    return F.cross_entropy(logits.float().flatten(0, 2), tgt.flatten(), ignore_index=SPECIAL)


def render_samples(model, codec, tag_sets, n_tags, out_dir, step, writer, device):
    tags = torch.zeros(len(tag_sets), n_tags, device=device)
    for i, ts in enumerate(tag_sets):
        tags[i, ts] = 1.0
    codes = model.generate(tags, frames=5 * FRAME_RATE)
    codes = codes.clamp(max=CARD - 1)
    with torch.no_grad():
        wav = codec.decode(codes)
    os.makedirs(os.path.join(out_dir, "samples"), exist_ok=True)
    for i in range(wav.shape[0]):
        audio = wav[i, 0].float().cpu()
        sf.write(os.path.join(out_dir, "samples", f"{step:07d}_{i}.wav"), audio.numpy(), codec.sample_rate)
        writer.add_audio(f"sample/{i}", audio, step, sample_rate=codec.sample_rate)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codes", required=True)
    ap.add_argument("--tags", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--codec", default="facebook/encodec_32khz")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--sample-every", type=int, default=10_000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    random.seed(1234 + rank)

    with open(args.tags) as f:
        meta = json.load(f)
    frames = int(args.seconds * FRAME_RATE)
    train_ds = SfxCodes(args.codes, meta, "train", frames)
    valid_ds = SfxCodes(args.codes, meta, "valid", frames)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)
    vdl = DataLoader(valid_ds, args.batch_size, sampler=DistributedSampler(valid_ds, shuffle=False, drop_last=True),
                     num_workers=2)

    model = DDP(SfxLM(train_ds.n_tags).to(device), device_ids=[local_rank])
    # lr below was tuned at 8 GPUs x 16 clips
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps, pct_start=0.02)

    writer, codec = None, None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))
        codec = CompressionModel.get_pretrained(args.codec, device=device).eval()
    sample_tags = [[0], [3, 17], [42], [5, 8, 9]]

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for codes, tags in dl:
            codes, tags = codes.to(device, non_blocking=True), tags.to(device, non_blocking=True)
            drop = (torch.rand(tags.shape[0], 1, device=device) < 0.1).float()
            tags = tags * (1 - drop)
            loss = lm_loss(model, codes, tags)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item(), step)
                    print(f"step {step} loss {l.item():.4f}", flush=True)

            if step % args.sample_every == 0:
                model.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad():
                    for codes, tags in vdl:
                        codes, tags = codes.to(device), tags.to(device)
                        tot += torch.stack([lm_loss(model.module, codes, tags) * codes.shape[0],
                                            torch.tensor(float(codes.shape[0]), device=device)])
                dist.all_reduce(tot)
                if rank == 0:
                    writer.add_scalar("valid/loss", (tot[0] / tot[1]).item(), step)
                    render_samples(model, codec, sample_tags, train_ds.n_tags, args.out, step, writer, device)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.out, f"lm_{step:07d}.pt"))
                model.train()
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
