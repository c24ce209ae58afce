"""Large multi-track REMI LM (Lakh MIDI, programs in one stream) trained with FSDP.

Tokens are pre-computed by tools/pretokenize_lmd.py into one memmap:
    <data>/tokens_{train,valid}.bin  (uint16) and <data>/offsets_{train,valid}.npy (piece boundaries)

torchrun --nproc_per_node=8 06_fsdp_large_music_lm.py --data data/lmd_remi_prog --out runs/lmd_1b
"""
import argparse
import functools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MemmapWindows(Dataset):
    def __init__(self, data_dir, split, seq_len, transpose=0, pitch_range=None):
        self.tokens = np.memmap(os.path.join(data_dir, f"tokens_{split}.bin"), dtype=np.uint16, mode="r")
        offsets = np.load(os.path.join(data_dir, f"offsets_{split}.npy"))
        self.seq_len, self.transpose, self.pitch_range = seq_len, transpose, pitch_range
        starts = []
        for a, b in zip(offsets[:-1], offsets[1:]):      # windows never cross piece boundaries
            if b - a < 128:
                continue
            starts.extend(range(a, max(a + 1, b - seq_len), seq_len // 2))
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = offsets[1:][np.searchsorted(offsets[1:], self.starts, side="right")]

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        a = self.starts[i]
        b = min(a + self.seq_len + 1, self.ends[i])
        w = np.asarray(self.tokens[a:b], dtype=np.int64)
        if self.transpose:
            lo, hi = self.pitch_range                     # melodic pitch tokens, drums use PitchDrum_*
            m = (w >= lo) & (w <= hi)
            if m.any():
                k = np.random.randint(-self.transpose, self.transpose + 1)
                if w[m].min() + k >= lo and w[m].max() + k <= hi:
                    w[m] += k
        x = np.zeros(self.seq_len + 1, dtype=np.int64)
        x[:len(w)] = w
        return torch.from_numpy(x)


def t5_bucket(rel, num_buckets=64, max_distance=2048):
    n = (-rel).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(n.float() / max_exact + 1e-6) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    return torch.where(n < max_exact, n, large.clamp(max=num_buckets - 1))


class Block(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.p = p

    def forward(self, x, bias):
        b, l, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, l, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.p if self.training else 0.0)
        x = x + self.o(a.transpose(1, 2).reshape(b, l, d))
        return x + self.mlp(self.ln2(x))


class MusicLM(nn.Module):
    def __init__(self, vocab, d=2048, layers=20, heads=16, p=0.0, buckets=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rel = nn.Embedding(buckets, heads)
        self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.buckets = buckets

    def forward(self, x):
        l = x.size(1)
        pos = torch.arange(l, device=x.device)
        bias = self.rel(t5_bucket(pos[None, :] - pos[:, None], self.buckets)).permute(2, 0, 1)
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))[None].to(self.emb.weight.dtype)
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h, bias)
        return self.head(self.ln(h))


def save_checkpoint(model, optim, step, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optim)
    torch.save({"model": model_state, "optim": optim_state, "step": step}, path)


@torch.no_grad()
def evaluate(model, loader, device, n_total, rank, world):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    seen = 0
    for seq in loader:
        seq = seq.to(device)
        logits = model(seq[:, :-1]).float()
        nll = F.cross_entropy(logits.transpose(1, 2), seq[:, 1:], ignore_index=0, reduction="none").sum(1)
        # DistributedSampler pads the last round with repeated windows; do not count them
        gpos = rank + (seen + torch.arange(len(seq), device=device)) * world
        keep = (gpos < n_total).double()
        s[0] += (nll.double() * keep).sum()
        s[1] += ((seq[:, 1:] != 0).sum(1).double() * keep).sum()
        seen += len(seq)
    dist.all_reduce(s)
    model.train()
    return math.exp(s[0] / s[1])


@torch.no_grad()
def sample_all_ranks(model, bos, n, device, seed):
    # every rank must run the same forwards under FSDP; rank 0 keeps the result
    g = torch.Generator(device=device).manual_seed(seed)
    seq = torch.tensor([[bos]], device=device)
    model.eval()
    for _ in range(n):
        logits = model(seq[:, -2048:])[:, -1].float() / 0.95
        v, _ = logits.topk(40)
        logits[logits < v[:, -1:]] = -float("inf")
        seq = torch.cat([seq, torch.multinomial(logits.softmax(-1), 1, generator=g)], 1)
    model.train()
    return seq[0].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/lmd_1b")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=4)
    ap.add_argument("--global_bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--init_from", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    accum = args.global_bs // (args.micro_bs * world)
    assert accum * args.micro_bs * world == args.global_bs, "global_bs must divide evenly"

    tok = REMI(params=os.path.join(args.data, "tokenizer.json"))
    pitch = sorted(i for t, i in tok.vocab.items() if t.startswith("Pitch_"))
    train_set = MemmapWindows(args.data, "train", args.seq_len, transpose=5, pitch_range=(pitch[0], pitch[-1]))
    val_set = MemmapWindows(args.data, "valid", args.seq_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=1)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_dl = DataLoader(train_set, args.micro_bs, sampler=train_sampler, num_workers=6, pin_memory=True,
                          drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_set, args.micro_bs, sampler=val_sampler, num_workers=2)

    torch.manual_seed(0)
    model = MusicLM(len(tok.vocab))
    if args.init_from:
        model.load_state_dict(torch.load(args.init_from, map_location="cpu")["model"])
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=device,
        use_orig_params=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1, (s + 1) / args.warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    step, epoch, t0 = 0, 0, time.time()
    it = None
    while step < args.steps:
        if it is None:
            train_sampler.set_epoch(epoch)
            it = iter(train_dl)
        loss_acc = 0.0
        for micro in range(accum):
            try:
                seq = next(it)
            except StopIteration:
                epoch += 1
                train_sampler.set_epoch(epoch)
                it = iter(train_dl)
                seq = next(it)
            seq = seq.to(device, non_blocking=True)
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), seq[:, 1:], ignore_index=0) / accum
            if micro < accum - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            loss_acc += loss.item()
        gnorm = model.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if rank == 0 and step % 20 == 0:
            tps = 20 * args.global_bs * args.seq_len / (time.time() - t0)
            print(f"step {step} loss {loss_acc:.4f} gnorm {gnorm:.2f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{tps / 1e3:.1f}k tok/s", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0:
            ppl = evaluate(model, val_dl, device, len(val_set), rank, world)
            ids = sample_all_ranks(model, tok["BOS_None"], 1024, device, seed=step)
            if rank == 0:
                print(f"step {step} val ppl {ppl:.3f}", flush=True)
                tok.decode(ids).dump_midi(os.path.join(args.out, "samples", f"{step:06d}.mid"))
        if step % args.save_every == 0:
            if rank == 0:
                save_checkpoint(model, opt, step, os.path.join(args.out, f"step{step:06d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
