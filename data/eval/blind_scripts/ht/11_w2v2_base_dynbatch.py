# wav2vec 2.0 pretraining with length-bucketed dynamic batches.
#
# torchrun --nproc_per_node=8 11_w2v2_base_dynbatch.py --manifest-dir /data/manifests/ls960 \
#     --out /shared/exp/w2v2_bucket --epochs 300
import argparse
import json
import math
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
from torch.utils.data import DataLoader, Dataset, Sampler

CONV_LAYERS = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def conv_out(n):
    for _, k, s in CONV_LAYERS:
        n = (n - k) // s + 1
    return n


class DistributedBucketBatchSampler(Sampler):
    """Groups utterances of similar length into batches of at most `max_frames`
    padded samples, then deals whole batches out to the ranks."""

    def __init__(self, lengths, max_frames, num_replicas, rank, seed=0, shuffle=True, even=True):
        self.lengths, self.max_frames = lengths, max_frames
        self.num_replicas, self.rank, self.seed, self.shuffle = num_replicas, rank, seed, shuffle
        # even=True repeats a few batches so that every rank runs the same number of steps
        self.even = even
        self.epoch = 0
        self.num_batches = len(self._make_batches(random.Random(seed)))

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _make_batches(self, rng):
        idx = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], rng.random()))
        batches, cur, longest = [], [], 0
        for i in idx:
            longest_new = max(longest, self.lengths[i])
            if cur and longest_new * (len(cur) + 1) > self.max_frames:
                batches.append(cur)
                cur, longest_new = [], self.lengths[i]
            cur.append(i)
            longest = longest_new
        if cur:
            batches.append(cur)
        return batches

    def __iter__(self):
        rng = random.Random(self.seed + self.epoch)
        batches = self._make_batches(rng)
        if self.shuffle:
            rng.shuffle(batches)
        if self.even:
            total = math.ceil(len(batches) / self.num_replicas) * self.num_replicas
            batches += batches[: total - len(batches)]
        return iter(batches[self.rank::self.num_replicas])

    def __len__(self):
        if self.even:
            return math.ceil(self.num_batches / self.num_replicas)
        return len(range(self.rank, self.num_batches, self.num_replicas))


class Utterances(Dataset):
    def __init__(self, tsv, max_len):
        with open(tsv) as f:
            self.root = f.readline().strip()
            pairs = [l.rstrip("\n").split("\t") for l in f]
        self.paths = [p for p, _ in pairs]
        self.lengths = [min(int(n), max_len) for _, n in pairs]
        self.max_len = max_len

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        w, _ = sf.read(os.path.join(self.root, self.paths[i]), dtype="float32")
        if len(w) > self.max_len:
            o = np.random.randint(len(w) - self.max_len + 1)
            w = w[o:o + self.max_len]
        return torch.from_numpy((w - w.mean()) / (w.std() + 1e-5))


def pad_batch(wavs):
    L = max(len(w) for w in wavs)
    x = torch.zeros(len(wavs), L)
    for i, w in enumerate(wavs):
        x[i, :len(w)] = w
    flen = torch.tensor([conv_out(len(w)) for w in wavs])
    pad = torch.arange(conv_out(L))[None, :] >= flen[:, None]
    return x, pad


class Wav2Vec2(nn.Module):
    def __init__(self, d=768, n_layers=12, final_dim=256, G=2, V=320):
        super().__init__()
        layers, c = [], 1
        for j, (o, k, s) in enumerate(CONV_LAYERS):
            layers += [nn.Conv1d(c, o, k, s, bias=False)] + ([nn.GroupNorm(o, o)] if j == 0 else []) + [nn.GELU()]
            c = o
        self.cnn = nn.Sequential(*layers)
        self.ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.rand(d))
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.enc = nn.ModuleList([nn.TransformerEncoderLayer(d, 12, 4 * d, 0.1, "gelu", batch_first=True)
                                  for _ in range(n_layers)])
        self.enc_ln = nn.LayerNorm(d)
        self.G, self.V = G, V
        self.wproj = nn.Linear(512, G * V)
        self.codebook = nn.Parameter(torch.rand(G, V, final_dim // G))
        self.q_out = nn.Linear(final_dim, final_dim)
        self.c_out = nn.Linear(d, final_dim)
        self.temp = 2.0

    def forward(self, wav, pad, mask, n_neg=100):
        f = self.ln(self.cnn(wav.unsqueeze(1)).transpose(1, 2))
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(f.dtype), self.proj(f))
        x = self.enc_ln(x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        for blk in self.enc:
            x = blk(x, src_key_padding_mask=pad)
        c = self.c_out(x)
        B, T, _ = f.shape
        z = self.wproj(f).float().view(B, T, self.G, self.V)
        avg = z.softmax(-1)[~pad].mean(0)
        ppl = torch.exp(-(avg * (avg + 1e-7).log()).sum(-1)).sum()
        oh = F.gumbel_softmax(z, tau=self.temp, hard=True) if self.training else F.one_hot(z.argmax(-1), self.V).float()
        q = self.q_out(torch.einsum("btgv,gvd->btgd", oh, self.codebook.float()).flatten(2).to(c.dtype))
        with torch.no_grad():
            lens = (~pad).sum(1)
            ni = (torch.rand(B, T, n_neg, device=q.device) * (lens - 1)[:, None, None]).long()
            ni += (ni >= torch.arange(T, device=q.device)[None, :, None]).long()
            ni += torch.arange(B, device=q.device)[:, None, None] * T
        negs = q.flatten(0, 1)[ni.flatten()].view(B, T, n_neg, -1)
        lg = F.cosine_similarity(c.float().unsqueeze(2), torch.cat([q.unsqueeze(2), negs], 2).float(), -1) / 0.1
        return lg[mask & ~pad], ppl, f.float().pow(2).mean()


def draw_mask(pad, p=0.65, span=10):
    B, T = pad.shape
    m = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate((~pad).sum(1).tolist()):
        k = min(int(p * n / span + random.random()), n - span)
        for s in random.sample(range(n - span), k):
            m[b, s:s + span] = True
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--max-frames", type=int, default=1_400_000, help="padded samples per GPU batch")
    ap.add_argument("--max-len", type=int, default=250_000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-epochs", type=int, default=8)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train = Utterances(os.path.join(args.manifest_dir, "train.tsv"), args.max_len)
    valid = Utterances(os.path.join(args.manifest_dir, "valid.tsv"), args.max_len)
    tsampler = DistributedBucketBatchSampler(train.lengths, args.max_frames, world, rank, seed=13)
    vsampler = DistributedBucketBatchSampler(valid.lengths, args.max_frames, world, rank, shuffle=False, even=False)
    tloader = DataLoader(train, batch_sampler=tsampler, collate_fn=pad_batch, num_workers=8, pin_memory=True)
    vloader = DataLoader(valid, batch_sampler=vsampler, collate_fn=pad_batch, num_workers=2)

    model = DDP(Wav2Vec2().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    total = args.epochs * len(tloader)
    warm = args.warmup_epochs * len(tloader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / warm if s < warm else max(0.0, (total - s) / (total - warm)))

    start_epoch = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if os.path.isfile(ckpt_path):
        ck = torch.load(ckpt_path, map_location=dev)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        metrics_f = open(os.path.join(args.out, "metrics.jsonl"), "a")

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0, seen = time.time(), 0
        for it, (wav, pad) in enumerate(tloader):
            mask = draw_mask(pad)
            wav, pad, mask = wav.to(dev, non_blocking=True), pad.to(dev), mask.to(dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, ppl, pen = model(wav, pad, mask)
            nv = 2 * 320
            loss = F.cross_entropy(logits, logits.new_zeros(len(logits), dtype=torch.long))
            loss = loss + 0.1 * (nv - ppl) / nv + 10.0 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            model.module.temp = max(0.5, 2.0 * 0.999995 ** sched.last_epoch)
            seen += wav.size(0)
            if it % 200 == 0 and rank == 0:
                print(f"epoch {epoch} it {it}/{len(tloader)} loss {loss.item():.4f} ppl {ppl.item():.1f} "
                      f"lr {sched.get_last_lr()[0]:.2e} utt/s {seen * world / (time.time() - t0):.1f}", flush=True)

        model.eval()
        agg = torch.zeros(3, device=dev)
        with torch.no_grad():
            for wav, pad in vloader:
                mask = draw_mask(pad)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits, _, _ = model.module(wav.to(dev), pad.to(dev), mask.to(dev))
                agg += torch.stack([F.cross_entropy(logits, logits.new_zeros(len(logits), dtype=torch.long),
                                                    reduction="sum").float(),
                                    (logits.argmax(-1) == 0).sum().float(),
                                    torch.tensor(float(len(logits)), device=dev)])
        dist.all_reduce(agg)
        if rank == 0:
            rec = {"epoch": epoch, "valid_loss": (agg[0] / agg[2]).item(), "valid_acc": (agg[1] / agg[2]).item()}
            metrics_f.write(json.dumps(rec) + "\n")
            metrics_f.flush()
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        metrics_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
