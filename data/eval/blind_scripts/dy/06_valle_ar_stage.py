"""VALL-E stage 1: autoregressive model over the first EnCodec codebook,
conditioned on phonemes and an acoustic prompt from the same speaker.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        06_valle_ar_stage.py --data /lustre/tts/libriheavy_codes --out /lustre/tts/exp/valle_ar
"""
import argparse
import json
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_PHONES = 512
CARD = 1024
EOS = CARD  # audio vocabulary = 1024 codes + EOS
PAD = CARD + 1


class UtteranceSet(Dataset):
    """manifest.jsonl lines: {"id", "phones": [int], "codes": "rel/path.npy"}; codes are [8, T]."""

    def __init__(self, root, split, max_frames=1200):
        self.root = root
        with open(os.path.join(root, f"{split}.jsonl")) as f:
            items = [json.loads(l) for l in f]
        self.items = [it for it in items if it["n_frames"] <= max_frames]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        codes = np.load(os.path.join(self.root, it["codes"]))
        return torch.tensor(it["phones"], dtype=torch.long), torch.from_numpy(codes[0].astype(np.int64))


def collate(batch):
    phones, codes = zip(*batch)
    codes = [torch.cat([c, c.new_tensor([EOS])]) for c in codes]
    return (pad_sequence(phones, batch_first=True, padding_value=0),
            torch.tensor([len(p) for p in phones]),
            pad_sequence(codes, batch_first=True, padding_value=PAD),
            torch.tensor([len(c) for c in codes]))


class SinePos(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, self.dim, 2, device=x.device) * (-math.log(10000.0) / self.dim))
        pe = torch.cat([torch.sin(t * freq), torch.cos(t * freq)], -1)
        return x + self.alpha * pe.to(x.dtype)


class ValleAR(nn.Module):
    def __init__(self, dim=1024, heads=16, layers=12):
        super().__init__()
        self.phone_emb = nn.Embedding(N_PHONES, dim)
        self.audio_emb = nn.Embedding(CARD + 2, dim)
        self.phone_pos, self.audio_pos = SinePos(dim), SinePos(dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, CARD + 1)

    def forward(self, phones, phone_lens, audio, audio_lens):
        """Prefix LM: phones attend bidirectionally to each other, audio is causal."""
        x_p = self.phone_pos(self.phone_emb(phones))
        x_a = self.audio_pos(self.audio_emb(audio))
        x = torch.cat([x_p, x_a], 1)
        tp, ta = phones.shape[1], audio.shape[1]
        mask = torch.zeros(tp + ta, tp + ta, dtype=torch.bool, device=x.device)
        mask[:tp, tp:] = True
        mask[tp:, tp:] = torch.triu(torch.ones(ta, ta, dtype=torch.bool, device=x.device), 1)
        pad = torch.cat([torch.arange(tp, device=x.device)[None] >= phone_lens[:, None],
                         torch.arange(ta, device=x.device)[None] >= audio_lens[:, None]], 1)
        h = self.decoder(x, mask=mask, src_key_padding_mask=pad)
        return self.head(h[:, tp:])

    @torch.no_grad()
    def generate(self, phones, phone_lens, prompt, max_new=600, top_k=50, temperature=1.0):
        out = prompt
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
        for _ in range(max_new):
            lens = torch.full((out.shape[0],), out.shape[1], device=out.device)
            logits = self(phones, phone_lens, out, lens)[:, -1] / temperature
            v, _ = logits.topk(top_k)
            logits[logits < v[:, -1:]] = -float("inf")
            nxt = torch.multinomial(logits.softmax(-1), 1).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)
            out = torch.cat([out, nxt[:, None]], 1)
            done |= nxt == EOS
            if done.all():
                break
        return out[:, prompt.shape[1]:]


def ar_loss(model, phones, plens, codes, clens):
    inp = codes[:, :-1].clone()
    inp[inp == PAD] = EOS
    logits = model(phones, plens, inp, clens - 1)
    return F.cross_entropy(logits.transpose(1, 2), codes[:, 1:], ignore_index=PAD)


@torch.no_grad()
def evaluate(model, loader, device, rank, world, prompt_frames=225):
    net = model.module
    net.eval()
    sums = torch.zeros(2, device=device)
    first = None
    for phones, plens, codes, clens in loader:
        phones, plens, codes, clens = [t.to(device) for t in (phones, plens, codes, clens)]
        sums[0] += ar_loss(net, phones, plens, codes, clens) * phones.shape[0]
        sums[1] += phones.shape[0]
        if first is None:
            first = (phones[:4], plens[:4], codes[:4, :prompt_frames])
    dist.all_reduce(sums)

    # sampled continuations: codebook usage and EOS rate across all ranks
    gen = net.generate(*first)
    gathered = [torch.zeros_like(gen) for _ in range(world)]
    dist.all_gather(gathered, gen)
    stats = {}
    if rank == 0:
        allgen = torch.cat(gathered)
        valid = allgen[allgen < EOS]
        hist = torch.bincount(valid, minlength=CARD).float()
        p = hist / hist.sum()
        stats = {
            "gen_entropy": float(-(p[p > 0] * p[p > 0].log()).sum()),
            "gen_eos_rate": float((allgen == EOS).any(1).float().mean()),
            "gen_mean_len": float((allgen < EOS).sum(1).float().mean()),
        }
    net.train()
    return (sums[0] / sums[1]).item(), stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-per-gpu", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=4000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337 + rank)

    train_ds, valid_ds = UtteranceSet(args.data, "train"), UtteranceSet(args.data, "valid")
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    valid_sampler = DistributedSampler(valid_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_per_gpu, sampler=train_sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(valid_ds, args.batch_per_gpu, sampler=valid_sampler, collate_fn=collate, num_workers=2)

    model = DDP(ValleAR().to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    # Noam-style schedule, peak lr tuned for 32 GPUs x 12 utterances
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for phones, plens, codes, clens in train_dl:
            phones, plens, codes, clens = [t.to(device, non_blocking=True) for t in (phones, plens, codes, clens)]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ar_loss(model, phones, plens, codes, clens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                l = loss.detach().float()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item() / world:.4f} lr {sched.get_last_lr()[0]:.2e}",
                          flush=True)

            if step % args.eval_every == 0:
                val_loss, gen_stats = evaluate(model, valid_dl, device, rank, world)
                if rank == 0:
                    print(f"[eval] step {step} val_loss {val_loss:.4f} {gen_stats}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch},
                               os.path.join(args.out, f"ar_{step:07d}.pt"))
                dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
