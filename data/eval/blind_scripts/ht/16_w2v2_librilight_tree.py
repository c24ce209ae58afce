"""wav2vec 2.0 pretraining directly on a Libri-Light style directory tree
(speaker/book/*.flac), without a precomputed fairseq manifest.  The file index
(path + number of samples) is built once and cached next to the data.

    torchrun --nproc_per_node 8 16_w2v2_librilight_tree.py --audio-root /datasets/librilight/medium \
        --exp /exp/w2v2_ll_medium
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger(__name__)
CONV = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def conv_frames(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


def build_index(audio_root, cache_file, min_samples, max_samples):
    """Returns [(relative_path, num_samples)] for every usable flac under audio_root."""
    if os.path.exists(cache_file):
        with open(cache_file) as f:
            return [(p, int(n)) for p, n in (l.rstrip("\n").split("\t") for l in f)]
    index = []
    for dirpath, _, files in os.walk(audio_root):
        for fn in sorted(files):
            if not fn.endswith(".flac"):
                continue
            full = os.path.join(dirpath, fn)
            n = sf.info(full).frames
            if min_samples <= n <= max_samples:
                index.append((os.path.relpath(full, audio_root), n))
    index.sort()
    os.makedirs(os.path.dirname(cache_file), exist_ok=True)
    with open(cache_file, "w") as f:
        for p, n in index:
            f.write(f"{p}\t{n}\n")
    return index


class FlacDataset(Dataset):
    def __init__(self, root, index, crop):
        self.root, self.index, self.crop = root, index, crop

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        rel, n = self.index[i]
        if n > self.crop:
            start = random.randint(0, n - self.crop)
            wav, _ = sf.read(os.path.join(self.root, rel), start=start, frames=self.crop, dtype="float32")
        else:
            wav, _ = sf.read(os.path.join(self.root, rel), dtype="float32")
        return torch.from_numpy(wav)


def collate(batch):
    n = min(len(w) for w in batch)
    out = []
    for w in batch:
        s = random.randint(0, len(w) - n)
        w = w[s:s + n]
        out.append((w - w.mean()) / (w.std() + 1e-5))
    return torch.stack(out)


class Quantizer(nn.Module):
    def __init__(self, G=2, V=320, dim=256):
        super().__init__()
        self.G, self.V = G, V
        self.logits = nn.Linear(512, G * V)
        self.vars = nn.Parameter(torch.FloatTensor(G * V, dim // G).uniform_())
        self.temp = 2.0

    def forward(self, f):
        B, T, _ = f.shape
        z = self.logits(f).float().view(-1, self.G, self.V)
        p = z.softmax(-1).mean(0)
        ppl = torch.exp(-(p * (p + 1e-7).log()).sum(-1)).sum()
        oh = F.gumbel_softmax(z, tau=self.temp, hard=True) if self.training else F.one_hot(z.argmax(-1), self.V).float()
        q = torch.einsum("ngv,gvd->ngd", oh, self.vars.float().view(self.G, self.V, -1))
        return q.reshape(B, T, -1), ppl


class Wav2Vec2(nn.Module):
    def __init__(self, d=768, L=12, final=256, n_neg=100):
        super().__init__()
        mods, c = [], 1
        for i, (o, k, s) in enumerate(CONV):
            mods += [nn.Conv1d(c, o, k, s, bias=False)] + ([nn.GroupNorm(o, o)] if i == 0 else []) + [nn.GELU()]
            c = o
        self.fe = nn.Sequential(*mods)
        self.fe_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.FloatTensor(d).uniform_())
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.enc_ln = nn.LayerNorm(d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True), L,
                                         enable_nested_tensor=False)
        self.final_proj = nn.Linear(d, final)
        self.quantizer = Quantizer(dim=final)
        self.project_q = nn.Linear(final, final)
        self.n_neg = n_neg

    def forward(self, wav, mask):
        f = self.fe_ln(self.fe(wav[:, None]).transpose(1, 2))
        x = torch.where(mask[..., None], self.mask_emb.to(f.dtype), self.proj(f))
        x = self.enc_ln(x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        c = self.final_proj(self.enc(x))
        q, ppl = self.quantizer(f)
        q = self.project_q(q.to(c.dtype))
        B, T, D = q.shape
        with torch.no_grad():
            ni = torch.randint(0, T - 1, (B, T, self.n_neg), device=q.device)
            ni += (ni >= torch.arange(T, device=q.device)[None, :, None]).long()
            ni += (torch.arange(B, device=q.device) * T)[:, None, None]
        negs = q.reshape(-1, D)[ni.view(-1)].view(B, T, self.n_neg, D)
        lg = F.cosine_similarity(c.float()[:, :, None], torch.cat([q[:, :, None], negs], 2).float(), -1) / 0.1
        return lg[mask], ppl, f.float().pow(2).mean()


def sample_mask(B, T, p=0.65, L=10):
    m = np.zeros((B, T), dtype=bool)
    k = int(p * T / L + np.random.rand())
    for b in range(B):
        st = np.random.choice(T - L, k, replace=False)
        m[b, (st[:, None] + np.arange(L)).ravel()] = True
    return torch.from_numpy(m)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--audio-root", required=True)
    ap.add_argument("--valid-root", default=None, help="defaults to <audio-root>/../dev")
    ap.add_argument("--exp", required=True)
    ap.add_argument("--crop", type=int, default=250000)
    ap.add_argument("--min-samples", type=int, default=32000)
    ap.add_argument("--max-samples", type=int, default=16000 * 60 * 20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--accum", type=int, default=8, help="8 GPUs x 8 x 8 utterances per update")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32000)
    ap.add_argument("--max-update", type=int, default=400000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    valid_root = args.valid_root or os.path.join(os.path.dirname(args.audio_root.rstrip("/")), "dev")
    cache_dir = os.path.join(args.audio_root, ".index_cache")
    train_idx = build_index(args.audio_root, os.path.join(cache_dir, f"train_{args.min_samples}_{args.max_samples}.tsv"),
                            args.min_samples, args.max_samples)
    valid_idx = build_index(valid_root, os.path.join(cache_dir, f"valid_{args.min_samples}_{args.max_samples}.tsv"),
                            args.min_samples, args.max_samples)
    logger.info("indexed %d train / %d valid files", len(train_idx), len(valid_idx))

    train = FlacDataset(args.audio_root, train_idx, args.crop)
    valid = FlacDataset(valid_root, valid_idx, args.crop)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=10,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    vloader = DataLoader(torch.utils.data.Subset(valid, range(rank, len(valid), world)), args.batch_size,
                         collate_fn=collate, num_workers=2)

    model = DDP(Wav2Vec2().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / args.warmup if s < args.warmup else max(0.0, (args.max_update - s) / (args.max_update - args.warmup)))
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    update, epoch, micro = 0, 0, 0
    while update < args.max_update:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav in loader:
            wav = wav.to(dev, non_blocking=True)
            mask = sample_mask(wav.size(0), conv_frames(wav.size(1))).to(dev)
            micro += 1
            boundary = micro % args.accum == 0
            with (model.no_sync() if not boundary else torch.enable_grad()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, ppl, pen = model(wav, mask)
                nv = 640
                loss = F.cross_entropy(logits, logits.new_zeros(len(logits), dtype=torch.long))
                loss = loss + 0.1 * (nv - ppl) / nv + 10 * pen
                (loss / args.accum).backward()
            if not boundary:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            model.module.quantizer.temp = max(0.5, 2.0 * 0.999995 ** update)
            if update % 100 == 0:
                r = torch.stack([loss.detach(), ppl.detach()]).float()
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
                logger.info("update %d loss %.4f ppl %.1f lr %.2e %.2fs/update", update, r[0], r[1],
                            sched.get_last_lr()[0], (time.time() - t0) / 100)
                t0 = time.time()
            if update % 10000 == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "update": update},
                           os.path.join(args.exp, f"checkpoint_{update}.pt"))
            if update >= args.max_update:
                break
        epoch += 1

        model.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for wav in vloader:
                wav = wav.to(dev)
                logits, _, _ = model.module(wav, sample_mask(wav.size(0), conv_frames(wav.size(1))).to(dev))
                acc += torch.tensor([(logits.argmax(-1) == 0).sum().item(), len(logits)], device=dev, dtype=torch.float)
        dist.all_reduce(acc)
        logger.info("epoch %d valid acc %.4f", epoch, (acc[0] / acc[1]).item())

    if rank == 0:
        torch.save({"model": model.module.state_dict(), "update": update}, os.path.join(args.exp, "checkpoint_last.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
