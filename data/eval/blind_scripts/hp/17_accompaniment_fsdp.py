"""Prefix-LM for piano accompaniment: [melody tokens] <SEP> [accompaniment tokens],
~700M params, trained with FSDP (FULL_SHARD) and non-reentrant activation checkpointing.

Tokenization (miditok REMI) is cached once to a shared directory by rank 0.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29400 \
        17_accompaniment_fsdp.py --pairs /shared/accomp_pairs --cache /shared/cache/accomp_remi --out /shared/runs/accomp_fsdp
"""
import argparse
import functools
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from miditok import REMI, TokenizerConfig
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def make_tokenizer():
    return REMI(TokenizerConfig(num_velocities=32, use_chords=True, use_tempos=True,
                                special_tokens=["PAD", "BOS", "EOS", "SEP"]))


def build_cache(pairs_dir, cache_dir, tokenizer):
    """pairs_dir/<id>/melody.mid + accomp.mid -> flat int32 stream + offsets (one file each)."""
    songs = sorted(p for p in Path(pairs_dir).iterdir() if (p / "melody.mid").exists())
    bos, eos, sep = tokenizer["BOS_None"], tokenizer["EOS_None"], tokenizer["SEP_None"]
    chunks, offsets, prefix_lens, ids = [], [0], [], []
    for song in songs:
        mel = tokenizer.encode(song / "melody.mid").ids
        acc = tokenizer.encode(song / "accomp.mid").ids
        seq = [bos] + mel + [sep] + acc + [eos]
        chunks.append(np.asarray(seq, dtype=np.int32))
        offsets.append(offsets[-1] + len(seq))
        prefix_lens.append(len(mel) + 2)
        ids.append(song.name)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = os.path.join(cache_dir, "tmp")
    os.makedirs(tmp, exist_ok=True)
    np.save(os.path.join(tmp, "tokens.npy"), np.concatenate(chunks))
    np.save(os.path.join(tmp, "offsets.npy"), np.asarray(offsets, dtype=np.int64))
    np.save(os.path.join(tmp, "prefix.npy"), np.asarray(prefix_lens, dtype=np.int64))
    with open(os.path.join(tmp, "ids.json"), "w") as f:
        json.dump(ids, f)
    for name in ("tokens.npy", "offsets.npy", "prefix.npy", "ids.json"):
        os.replace(os.path.join(tmp, name), os.path.join(cache_dir, name))
    with open(os.path.join(cache_dir, "DONE"), "w") as f:
        f.write("ok\n")


class PairSeqs(Dataset):
    def __init__(self, cache_dir, indices, max_len, pad_id):
        self.tokens = np.load(os.path.join(cache_dir, "tokens.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(cache_dir, "offsets.npy"))
        self.prefix = np.load(os.path.join(cache_dir, "prefix.npy"))
        self.indices, self.max_len, self.pad_id = list(indices), max_len, pad_id

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        j = self.indices[i]
        seq = np.asarray(self.tokens[self.offsets[j]:self.offsets[j + 1]][: self.max_len + 1], dtype=np.int64)
        x = np.full(self.max_len + 1, self.pad_id, dtype=np.int64)
        x[:len(seq)] = seq
        # loss only on the accompaniment part
        loss_mask = np.zeros(self.max_len, dtype=np.bool_)
        loss_mask[self.prefix[j] - 1: len(seq) - 1] = True
        return torch.from_numpy(x), torch.from_numpy(loss_mask)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class AccompLM(nn.Module):
    def __init__(self, vocab, d=1536, layers=24, heads=16, max_len=4096):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.size(1), device=x.device))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def masked_nll(logits, x, mask):
    ce = F.cross_entropy(logits.float().transpose(1, 2), x[:, 1:], reduction="none")
    return (ce * mask).sum(), mask.sum()


def save_full(model, path, rank):
    # all ranks take part in gathering the full state dict; only rank 0 receives and writes it
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        torch.save(state, path)
    dist.barrier()


@torch.no_grad()
def sample_lockstep(model, prompts, n_new, temperature=1.0, top_k=32):
    """Every rank must run the same number of forwards under FSDP (each one all-gathers
    the shards), so there is no early stop on EOS here; trimming happens afterwards."""
    x = prompts
    for _ in range(n_new):
        logits = model(x)[:, -1].float() / temperature
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
        x = torch.cat([x, torch.multinomial(logits.softmax(-1), 1)], 1)
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1.5e-4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--n_val", type=int, default=256)
    ap.add_argument("--gen_tokens", type=int, default=512)
    ap.add_argument("--init_from", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tokenizer = make_tokenizer()
    pad_id = tokenizer.pad_token_id
    if rank == 0 and not os.path.exists(os.path.join(args.cache, "DONE")):
        build_cache(args.pairs, args.cache, tokenizer)
    dist.barrier()

    n_songs = len(np.load(os.path.join(args.cache, "offsets.npy"))) - 1
    order = np.random.default_rng(12345).permutation(n_songs)  # same permutation on every rank
    val_idx, train_idx = order[:args.n_val], order[args.n_val:]
    train_ds = PairSeqs(args.cache, train_idx, args.max_len, pad_id)
    val_ds = PairSeqs(args.cache, val_idx, args.max_len, pad_id)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, args.bs, sampler=train_sampler, num_workers=6, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.bs, sampler=val_sampler, num_workers=2, drop_last=True)

    net = AccompLM(len(tokenizer), max_len=args.max_len)
    if args.init_from:
        net.load_state_dict(torch.load(args.init_from, map_location="cpu"))
    model = FSDP(net,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=local_rank)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (x, m) in enumerate(train_dl):
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)
            s, n = masked_nll(model(x[:, :-1]), x, m)
            loss = s / n.clamp(min=1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            if rank == 0 and i % 50 == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for x, m in val_dl:  # same number of batches on every rank (drop_last)
                x, m = x.to(device), m.to(device)
                s, n = masked_nll(model(x[:, :-1]), x, m)
                acc[0] += s
                acc[1] += n
            dist.all_reduce(acc)
            # accompaniment for one validation melody per rank
            j = int(val_idx[rank % len(val_idx)])
            pre = min(int(val_ds.prefix[j]), args.max_len // 2)
            prompt = torch.as_tensor(np.asarray(val_ds.tokens[val_ds.offsets[j]:val_ds.offsets[j] + pre],
                                                dtype=np.int64), device=device)[None]
            gen_len = min(args.gen_tokens, args.max_len - prompt.size(1))
            gen_len_t = torch.tensor([gen_len], device=device)
            dist.all_reduce(gen_len_t, op=dist.ReduceOp.MIN)
            gen = sample_lockstep(model, prompt, int(gen_len_t.item()))[:, pre:]
            gathered = [torch.empty_like(gen) for _ in range(world)]
            dist.all_gather(gathered, gen)
        model.train()

        if rank == 0:
            print(f"epoch {epoch} val nll {(acc[0] / acc[1]).item():.4f}", flush=True)
            sdir = Path(args.out) / "samples" / f"epoch{epoch:02d}"
            sdir.mkdir(parents=True, exist_ok=True)
            eos = tokenizer["EOS_None"]
            for r, g in enumerate(gathered):
                ids = g[0].tolist()
                ids = ids[: ids.index(eos)] if eos in ids else ids
                tokenizer.decode([ids]).dump_midi(sdir / f"rank{r}.mid")
        save_full(model, os.path.join(args.out, f"model_epoch{epoch:02d}.pt"), rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
