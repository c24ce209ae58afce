"""Pretrain a 1.4B decoder on raw jsonl shards with PP x FSDP2 x TP.

The jsonl text is tokenized once into a flat uint32 token file next to the data
(on the shared filesystem) and memory-mapped by the data loader afterwards.

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node01:29500 \
        pretrain_jsonl.py --data-glob '/nfs/corpus/web_2024/*.jsonl' --pp 2 --tp 2
"""
import argparse
import glob
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-glob", required=True)
    ap.add_argument("--tokenizer", default="EleutherAI/gpt-neox-20b")
    ap.add_argument("--out", default="/nfs/runs/web1p4b")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bsz", type=int, default=16, help="sequences per dp replica per step")
    ap.add_argument("--n-micro", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--ckpt-every", type=int, default=2500)
    return ap.parse_args()


def build_token_cache(files, tokenizer_name, cache_path, num_proc=16):
    if os.path.exists(cache_path):
        return np.memmap(cache_path, dtype=np.uint32, mode="r")
    tok = AutoTokenizer.from_pretrained(tokenizer_name)
    ds = load_dataset("json", data_files=files, split="train")

    def encode(batch):
        ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [tok.eos_token_id] for x in ids], "n": [len(x) + 1 for x in ids]}

    ds = ds.map(encode, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    total = int(np.sum(ds["n"], dtype=np.int64))
    arr = np.memmap(cache_path, dtype=np.uint32, mode="w+", shape=(total,))
    pos = 0
    for shard in ds.iter(batch_size=4096):
        flat = np.concatenate([np.asarray(x, dtype=np.uint32) for x in shard["ids"]])
        arr[pos:pos + len(flat)] = flat
        pos += len(flat)
    arr.flush()
    del arr
    return np.memmap(cache_path, dtype=np.uint32, mode="r")


class Windows(Dataset):
    def __init__(self, tokens, seq):
        self.tokens, self.seq = tokens, seq

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i):
        w = torch.from_numpy(self.tokens[i * self.seq: (i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.hd = dim // heads
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)
        self.mlp = SwiGLU(dim, int(8 * dim / 3 / 256 + 1) * 256)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.n1(x)
        q, k, v = (proj(h).view(B, T, -1, self.hd).transpose(1, 2) for proj in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.n2(x))


class PipeLM(nn.Module):
    def __init__(self, vocab, dim, heads, n_layers, seq, lo, hi, first, last):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim) if first else None
        self.pos = nn.Embedding(seq, dim) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(lo, hi)})
        self.norm = nn.RMSNorm(dim) if last else None
        self.head = nn.Linear(dim, vocab, bias=False) if last else None

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks.values():
            x = b(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


class Trainer(Stateful):
    def __init__(self, model, opt):
        self.model, self.opt, self.step = model, opt, 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o, "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = sd["step"]


def main():
    a = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (a.pp * a.tp)
    mesh = init_device_mesh("cuda", (a.pp, dp, a.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == a.pp - 1

    files = sorted(glob.glob(a.data_glob))
    cache = os.path.join(os.path.dirname(files[0]), f"tokens_{os.path.basename(a.tokenizer)}.u32")
    tokens = build_token_cache(files, a.tokenizer, cache)
    n_val = 2_000 * a.seq
    train_ds, val_ds = Windows(tokens[:-n_val], a.seq), Windows(tokens[-n_val:], a.seq)
    vocab = 50304

    torch.manual_seed(0)
    per = a.layers // a.pp
    with torch.device("meta"):
        model = PipeLM(vocab, a.dim, a.heads, a.layers, a.seq, pp_rank * per, (pp_rank + 1) * per, first, last)
    tp = mesh["tp"]
    if last:
        parallelize_module(model.head, tp, ColwiseParallel(output_layouts=Replicate()))
    for b in model.blocks.values():
        parallelize_module(b, tp, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                   "o": RowwiseParallel(), "mlp.w1": ColwiseParallel(),
                                   "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks.values():
        fully_shard(b, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=dev)
    with torch.no_grad():
        for n, p_ in model.named_parameters():
            if ".n1." in n or ".n2." in n or n.startswith("norm"):
                p_.fill_(1.0)
            else:
                p_.normal_(0.0, 0.02)

    stage = PipelineStage(model, pp_rank, a.pp, dev, group=mesh["pp"].get_group())
    sched = Schedule1F1B(stage, a.n_micro,
                         loss_fn=lambda lg, y: F.cross_entropy(lg.flatten(0, 1).float(), y.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / a.warmup if s < a.warmup
        else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - a.warmup) / (a.steps - a.warmup)))))

    tr_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    va_sampler = DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    tr_loader = DataLoader(train_ds, a.bsz, sampler=tr_sampler, num_workers=4, pin_memory=True, drop_last=True)
    va_loader = DataLoader(val_ds, a.bsz, sampler=va_sampler, num_workers=2, drop_last=True)

    trainer = Trainer(model, opt)
    ckpt_root = os.path.join(a.out, "checkpoints")
    done = sorted(d for d in glob.glob(os.path.join(ckpt_root, "step_*")) if os.path.exists(os.path.join(d, ".metadata")))
    if done:
        dcp.load({"trainer": trainer}, checkpoint_id=done[-1])
        lr_sched.last_epoch = trainer.step - 1
        lr_sched.step()

    def run(x, y, fn):
        out = [] if last else None
        if first:
            fn(x.to(dev), target=y.to(dev) if last else None, losses=out)
        else:
            fn(target=y.to(dev) if last else None, losses=out)
        return torch.stack(out).mean().detach() if last else torch.tensor(-1.0, device=dev)

    def to_log(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
        return t.item()

    epoch = trainer.step // len(tr_loader)
    tr_sampler.set_epoch(epoch)
    it = iter(tr_loader)
    while trainer.step < a.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            tr_sampler.set_epoch(epoch)
            it = iter(tr_loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        loss = run(x, y, sched.step)
        opt.step()
        lr_sched.step()
        trainer.step += 1

        if trainer.step % 25 == 0:
            v = to_log(loss)
            if rank == 0:
                print(f"step {trainer.step} loss {v:.4f} lr {lr_sched.get_last_lr()[0]:.2e}", flush=True)

        if trainer.step % a.eval_every == 0:
            model.eval()
            tot, n = torch.zeros((), device=dev), 0
            with torch.no_grad():
                for vx, vy in va_loader:
                    tot += run(vx, vy, sched.eval)
                    n += 1
            model.train()
            v = to_log(tot / max(n, 1))
            if rank == 0:
                print(f"step {trainer.step} val_loss {v:.4f} val_ppl {math.exp(v):.2f}", flush=True)

        if trainer.step % a.ckpt_every == 0:
            dcp.save({"trainer": trainer}, checkpoint_id=os.path.join(ckpt_root, f"step_{trainer.step:08d}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
