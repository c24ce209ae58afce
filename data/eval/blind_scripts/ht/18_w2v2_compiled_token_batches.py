# wav2vec 2.0 BASE with per-rank token-budget batching and torch.compile.
#
# Each rank shards the utterance list, packs its shard into batches of at most
# --max-tokens audio samples and then all ranks agree on a common number of
# steps for the epoch.
#
#   torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
#       18_w2v2_compiled_token_batches.py --data /fsx/ls960 --save-dir /fsx/exp/w2v2_tok_compiled
import argparse
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
from torch.utils.data import DataLoader, Dataset

CONV = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def feat_len(n):
    for _, k, s in CONV:
        n = (n - k) // s + 1
    return n


class W2V2(nn.Module):
    def __init__(self, d=768, depth=12, final=256, G=2, V=320, n_neg=100):
        super().__init__()
        mods, c = [], 1
        for i, (o, k, s) in enumerate(CONV):
            mods += [nn.Conv1d(c, o, k, s, bias=False)] + ([nn.GroupNorm(o, o)] if i == 0 else []) + [nn.GELU()]
            c = o
        self.cnn = nn.Sequential(*mods)
        self.cnn_ln = nn.LayerNorm(512)
        self.proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, 12, 3072, 0.1, "gelu", batch_first=True)
                                     for _ in range(depth)])
        self.final_proj = nn.Linear(d, final)
        self.G, self.V, self.n_neg = G, V, n_neg
        self.q_proj = nn.Linear(512, G * V)
        self.codevectors = nn.Parameter(torch.empty(G * V, final // G).uniform_())
        self.project_q = nn.Linear(final, final)
        self.register_buffer("temp", torch.tensor(2.0), persistent=False)

    def forward(self, wav, pad, mask):
        f = self.cnn_ln(self.cnn(wav[:, None]).transpose(1, 2))
        x = torch.where(mask[..., None], self.mask_emb.to(f.dtype), self.proj(f))
        x = self.ln(x + F.gelu(self.pos(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad)
        c = self.final_proj(x)
        B, T, _ = f.shape
        z = self.q_proj(f).float().view(B * T, self.G, self.V)
        avg = z.softmax(-1).mean(0)
        ppl = torch.exp(-(avg * (avg + 1e-7).log()).sum(-1)).sum()
        oh = F.gumbel_softmax(z, tau=float(self.temp), hard=True) if self.training else F.one_hot(z.argmax(-1), self.V).float()
        q = torch.einsum("ngv,gvd->ngd", oh, self.codevectors.float().view(self.G, self.V, -1)).reshape(B, T, -1)
        q = self.project_q(q.to(c.dtype))
        with torch.no_grad():
            valid = (~pad).sum(1)
            ni = (torch.rand(B, T, self.n_neg, device=q.device) * (valid - 1)[:, None, None]).long()
            ni = ni + (ni >= torch.arange(T, device=q.device)[None, :, None]).long()
            ni = ni + (torch.arange(B, device=q.device) * T)[:, None, None]
        negs = q.reshape(B * T, -1)[ni.view(-1)].view(B, T, self.n_neg, -1)
        lg = F.cosine_similarity(c.float()[:, :, None], torch.cat([q[:, :, None], negs], 2).float(), -1) / 0.1
        return lg, ppl, f.float().pow(2).mean()


def read_manifest(path, min_len, max_len):
    with open(path) as f:
        root = f.readline().strip()
        rows = [l.rstrip("\n").split("\t") for l in f]
    return [(os.path.join(root, p), min(int(n), max_len)) for p, n in rows if int(n) >= min_len]


def token_batches(items, idx, max_tokens):
    idx = sorted(idx, key=lambda i: items[i][1])
    out, cur, longest = [], [], 0
    for i in idx:
        n = items[i][1]
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


class BatchDataset(Dataset):
    """One item = one pre-built batch of utterance indices."""

    def __init__(self, items, batches, max_len):
        self.items, self.batches, self.max_len = items, batches, max_len

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, b):
        wavs = []
        for i in self.batches[b]:
            w, _ = sf.read(self.items[i][0], dtype="float32")
            if len(w) > self.max_len:
                s = random.randint(0, len(w) - self.max_len)
                w = w[s:s + self.max_len]
            wavs.append(torch.from_numpy((w - w.mean()) / (w.std() + 1e-5)))
        L = max(len(w) for w in wavs)
        x = torch.zeros(len(wavs), L)
        for j, w in enumerate(wavs):
            x[j, :len(w)] = w
        T = feat_len(L)
        flens = torch.tensor([feat_len(len(w)) for w in wavs])
        pad = torch.arange(T)[None] >= flens[:, None]
        mask = torch.zeros(len(wavs), T, dtype=torch.bool)
        for j, t in enumerate(flens.tolist()):
            k = min(int(0.65 * t / 10 + random.random()), t - 10)
            for s in random.sample(range(t - 10), k):
                mask[j, s:s + 10] = True
        return x, pad, mask


def epoch_batches(items, rank, world, max_tokens, seed, epoch, dev):
    g = random.Random(seed + epoch)
    order = list(range(len(items)))
    g.shuffle(order)
    mine = token_batches(items, order[rank::world], max_tokens)
    random.Random(seed + epoch + 1000 * rank).shuffle(mine)
    # shards pack into different numbers of batches; every rank must run the same number of DDP steps
    n = torch.tensor([len(mine)], device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return mine[: int(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--max-tokens", type=int, default=1_400_000)
    ap.add_argument("--max-len", type=int, default=250_000)
    ap.add_argument("--min-len", type=int, default=32_000)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32_000)
    ap.add_argument("--max-update", type=int, default=400_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    train = read_manifest(os.path.join(args.data, "train.tsv"), args.min_len, args.max_len)
    valid = read_manifest(os.path.join(args.data, "valid.tsv"), args.min_len, args.max_len)

    net = W2V2().to(dev)
    ddp = DDP(net, device_ids=[local_rank], gradient_as_bucket_view=True)
    model = ddp if args.no_compile else torch.compile(ddp)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / args.warmup if s < args.warmup else max(0.0, (args.max_update - s) / (args.max_update - args.warmup)))

    ckpt = os.path.join(args.save_dir, "checkpoint_last.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt):
        st = torch.load(ckpt, map_location="cpu")
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, epoch = st["step"], st["epoch"]

    while step < args.max_update:
        batches = epoch_batches(train, rank, world, args.max_tokens, args.seed, epoch, dev)
        loader = DataLoader(BatchDataset(train, batches, args.max_len), batch_size=None, shuffle=False,
                            num_workers=8, pin_memory=True)
        model.train()
        sums = torch.zeros(3, device=dev)
        t0 = time.time()
        for x, pad, mask in loader:
            x, pad, mask = x.to(dev, non_blocking=True), pad.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lg, ppl, pen = model(x, pad, mask)
            lg = lg[mask & ~pad]
            loss = F.cross_entropy(lg, torch.zeros(len(lg), dtype=torch.long, device=dev))
            loss = loss + 0.1 * (640 - ppl) / 640 + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            net.temp.fill_(max(0.5, 2.0 * 0.999995 ** step))
            sums += torch.stack([loss.detach().float(), ppl.detach().float(), torch.ones((), device=dev)])
            if step >= args.max_update:
                break
        epoch += 1
        dist.all_reduce(sums)
        if rank == 0:
            print(f"epoch {epoch} step {step} loss {sums[0] / sums[2]:.4f} ppl {sums[1] / sums[2]:.1f} "
                  f"lr {sched.get_last_lr()[0]:.2e} time {time.time() - t0:.0f}s", flush=True)

        # eval with the plain module: no DDP collectives, so shards may differ in size
        net.eval()
        acc = torch.zeros(2, device=dev)
        vb = token_batches(valid, list(range(rank, len(valid), world)), args.max_tokens)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for x, pad, mask in DataLoader(BatchDataset(valid, vb, args.max_len), batch_size=None, num_workers=2):
                lg, _, _ = net(x.to(dev), pad.to(dev), mask.to(dev))
                lg = lg[(mask & ~pad).to(dev)]
                acc += torch.stack([(lg.argmax(-1) == 0).sum().float(), torch.tensor(float(len(lg)), device=dev)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} valid acc {acc[0] / acc[1]:.4f}", flush=True)
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "epoch": epoch}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
