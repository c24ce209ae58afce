# GShard-style top-2 MoE GPT pretraining with einsum dispatch/combine.
# Experts are replicated on every GPU; DDP averages all gradients.
#
#   torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
#       04_moe_gpt_pretrain.py --corpus /shared/corpora/pile_subset --cache-dir /shared/cache/moe_gpt
import argparse
import glob
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", type=str, required=True, help="directory of *.jsonl with a 'text' field")
parser.add_argument("--cache-dir", type=str, required=True)
parser.add_argument("--tokenizer", type=str, default="EleutherAI/gpt-neox-20b")
parser.add_argument("--save-dir", type=str, default="/shared/ckpt/moe_gpt")
parser.add_argument("--block", type=int, default=2048)
parser.add_argument("--dim", type=int, default=1024)
parser.add_argument("--layers", type=int, default=16)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--experts", type=int, default=8)
parser.add_argument("--capacity-factor", type=float, default=2.0)
parser.add_argument("--bsz", type=int, default=4)
parser.add_argument("--lr", type=float, default=2e-4)
parser.add_argument("--warmup", type=int, default=2000)
parser.add_argument("--steps", type=int, default=60000)
parser.add_argument("--aux", type=float, default=0.01)
parser.add_argument("--zloss", type=float, default=1e-3)
parser.add_argument("--val-frac", type=float, default=0.005)
parser.add_argument("--save-every", type=int, default=2000)


def tokenize_corpus(corpus_dir, tokenizer):
    pieces = []
    for path in sorted(glob.glob(os.path.join(corpus_dir, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                text = json.loads(line)["text"]
                pieces.append(np.asarray(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id], dtype=np.uint16))
    return np.concatenate(pieces)


class Blocks(Dataset):
    def __init__(self, tokens, block):
        self.tokens, self.block = tokens, block

    def __len__(self):
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i):
        x = torch.from_numpy(self.tokens[i * self.block:(i + 1) * self.block + 1].astype(np.int64))
        return x[:-1], x[1:]


def top2_gating(logits, capacity):
    """logits: [G, S, E] -> combine weights [G, S, E, C], dispatch mask, aux loss, z loss, drop rate."""
    G, S, E = logits.shape
    gates = logits.softmax(-1)
    idx1 = gates.argmax(-1)
    mask1 = F.one_hot(idx1, E)
    idx2 = logits.masked_fill(mask1.bool(), float("-inf")).argmax(-1)
    mask2 = F.one_hot(idx2, E)

    me = gates.mean(1)
    ce = mask1.float().mean(1)
    aux = (me * ce).mean() * E * E
    zl = torch.logsumexp(logits, -1).pow(2).mean()

    loc1 = mask1.cumsum(1) - 1
    loc2 = mask2.cumsum(1) - 1 + mask1.sum(1, keepdim=True)
    routed = mask1.sum() + mask2.sum()
    mask1 = mask1 * (loc1 < capacity)
    mask2 = mask2 * (loc2 < capacity)
    drop = 1.0 - (mask1.sum() + mask2.sum()).float() / routed

    pos1 = (loc1 * mask1).sum(-1)
    pos2 = (loc2 * mask2).sum(-1)
    g1 = (gates * mask1).sum(-1)
    g2 = (gates * mask2).sum(-1)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    combine = (g1[..., None, None] * mask1[..., None] * F.one_hot(pos1, capacity)[..., None, :]
               + g2[..., None, None] * mask2[..., None] * F.one_hot(pos2, capacity)[..., None, :])
    return combine, combine > 0, aux, zl, drop


class MoEMLP(nn.Module):
    def __init__(self, dim, experts, cf):
        super().__init__()
        self.E, self.cf = experts, cf
        self.wg = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, dim, 4 * dim))
        self.w_out = nn.Parameter(torch.empty(experts, 4 * dim, dim))
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=0.02 / math.sqrt(2))

    def forward(self, x):
        G, S, D = x.shape  # one group per sequence
        capacity = int(math.ceil(2 * self.cf * S / self.E))
        with torch.autocast("cuda", enabled=False):
            logits = self.wg(x.float())
        combine, dispatch, aux, zl, drop = top2_gating(logits, capacity)
        xe = torch.einsum("gsec,gsd->egcd", dispatch.to(x.dtype), x)
        h = F.gelu(torch.einsum("egcd,edf->egcf", xe, self.w_in.to(x.dtype)))
        ye = torch.einsum("egcf,efd->egcd", h, self.w_out.to(x.dtype))
        y = torch.einsum("gsec,egcd->gsd", combine.to(ye.dtype), ye)
        return y, aux, zl, drop


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, moe, experts, cf):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.moe = moe
        self.mlp = MoEMLP(dim, experts, cf) if moe else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, C))
        if self.moe:
            y, aux, zl, drop = self.mlp(self.norm2(x))
            return x + y, (aux, zl, drop)
        return x + self.mlp(self.norm2(x)), None


class MoEGPT(nn.Module):
    def __init__(self, vocab, a):
        super().__init__()
        self.emb = nn.Embedding(vocab, a.dim)
        self.pos = nn.Parameter(torch.zeros(1, a.block, a.dim))
        self.layers = nn.ModuleList(
            DecoderLayer(a.dim, a.heads, i % 2 == 1, a.experts, a.capacity_factor) for i in range(a.layers))
        self.norm = nn.LayerNorm(a.dim)
        self.out = nn.Linear(a.dim, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[:, :idx.size(1)]
        router = []
        for layer in self.layers:
            x, r = layer(x)
            if r is not None:
                router.append(r)
        aux, zl, drop = (torch.stack(t).mean() for t in zip(*router))
        return self.out(self.norm(x)), aux, zl, drop


def main():
    a = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    os.makedirs(a.cache_dir, exist_ok=True)
    cache = os.path.join(a.cache_dir, f"tokens_{a.tokenizer.replace('/', '__')}.npy")
    if not os.path.exists(cache):
        ids = tokenize_corpus(a.corpus, tok)
        np.save(cache, ids)
    tokens = np.load(cache, mmap_mode="r")
    n_val = int(len(tokens) * a.val_frac)
    train_ds, val_ds = Blocks(tokens[n_val:], a.block), Blocks(tokens[:n_val], a.block)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=a.bsz, sampler=train_sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=a.bsz, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                        num_workers=2)

    torch.manual_seed(0)
    model = DDP(MoEGPT(len(tok), a).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))))

    if rank == 0:
        os.makedirs(a.save_dir, exist_ok=True)
        print(f"train blocks {len(train_ds)}  val blocks {len(val_ds)}  world {world}", flush=True)

    step, epoch = 0, 0
    tic = time.time()
    while step < a.steps:
        train_sampler.set_epoch(epoch)
        for x, y in train_dl:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux, zl, drop = model(x)
                ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                loss = ce + a.aux * aux + a.zloss * zl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                t = torch.stack([ce.detach(), aux.detach(), drop.detach(), gnorm])
                dist.all_reduce(t)
                t /= world
                if rank == 0:
                    print(f"step {step} ce {t[0]:.3f} aux {t[1]:.3f} drop {t[2]:.2%} gnorm {t[3]:.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - tic) / 50:.2f}s/it", flush=True)
                    tic = time.time()

            if step % a.save_every == 0:
                model.eval()
                acc = torch.zeros(2, device=dev)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for i, (vx, vy) in enumerate(val_dl):
                        if i == 25:
                            break
                        vl, _, _, _ = model(vx.to(dev))
                        acc[0] += F.cross_entropy(vl.flatten(0, 1).float(), vy.to(dev).flatten(), reduction="sum")
                        acc[1] += vy.numel()
                dist.all_reduce(acc)
                model.train()
                if rank == 0:
                    print(f"step {step} val ppl {math.exp(acc[0] / acc[1]):.2f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(a.save_dir, f"step{step}.pt"))
                dist.barrier()
            if step >= a.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
