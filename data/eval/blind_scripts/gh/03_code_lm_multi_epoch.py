# Multi-epoch pretraining of a 3B code LM on a deduplicated code corpus.
# PP (GPipe) over nodes, FSDP2 over dp, TP inside the node.
#
#   srun --nodes 4 --ntasks-per-node 1 torchrun --nnodes 4 --nproc_per_node 8 \
#       --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29400 train_code_lm.py --config configs/code3b.json
import argparse
import json
import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger("code_lm")


@dataclass
class Config:
    data_dir: str = "/shared/datasets/code_dedup_tok"
    ckpt_dir: str = "/shared/checkpoints/code3b"
    dim: int = 2560
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 6912
    vocab_size: int = 49152
    seq_len: int = 4096
    pp: int = 4
    tp: int = 4
    batch_per_replica: int = 8
    microbatches: int = 8
    epochs: int = 4
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 1000
    weight_decay: float = 0.1
    seed: int = 0
    extra: dict = field(default_factory=dict)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, base=10000.0):
    # x: (b, s, h, d)
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x.float()[..., ::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class GQAttention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.head_dim = c.dim // c.n_heads
        self.rep = c.n_heads // c.n_kv_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = rope(self.wq(x).view(b, s, -1, self.head_dim))
        k = rope(self.wk(x).view(b, s, -1, self.head_dim))
        v = self.wv(x).view(b, s, -1, self.head_dim)
        k = k.repeat_interleave(self.rep, dim=2)
        v = v.repeat_interleave(self.rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attn_norm = RMSNorm(c.dim)
        self.attn = GQAttention(c)
        self.mlp_norm = RMSNorm(c.dim)
        self.gate = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class CodeLM(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleDict({str(i): Layer(c) for i in range(c.n_layers)})
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def make_stage(c: Config, pp_rank: int, tp_mesh, dp_mesh, device):
    with torch.device("meta"):
        m = CodeLM(c)
    n = c.n_layers // c.pp
    keep = {str(i) for i in range(pp_rank * n, (pp_rank + 1) * n)}
    for k in list(m.layers):
        if k not in keep:
            del m.layers[k]
    if pp_rank > 0:
        m.embed = None
    if pp_rank < c.pp - 1:
        m.norm, m.head = None, None

    if m.embed is not None:
        parallelize_module(m.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if m.head is not None:
        parallelize_module(m.head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
    for layer in m.layers.values():
        parallelize_module(layer, tp_mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in m.layers.values():
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(m, mesh=dp_mesh, mp_policy=mp)

    m.to_empty(device=device)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.normal_(p, std=0.02)
    return m


class PackedCode(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.load(path, mmap_mode="r")  # (N, seq_len + 1) uint32, packed offline
        assert self.arr.shape[1] == seq_len + 1

    def __len__(self):
        return self.arr.shape[0]

    def __getitem__(self, i):
        row = torch.from_numpy(np.asarray(self.arr[i], dtype=np.int64))
        return row[:-1], row[1:]


class AppState(Stateful):
    def __init__(self, model, optim, sched):
        self.model, self.optim, self.sched = model, optim, sched
        self.epoch = 0

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd, "sched": self.sched.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.epoch = sd["epoch"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    c = Config()
    if cli.config:
        with open(cli.config) as f:
            for k, v in json.load(f).items():
                setattr(c, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    world = int(os.environ["WORLD_SIZE"])
    dp = world // (c.pp * c.tp)
    mesh = init_device_mesh("cuda", (c.pp, dp, c.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    is_first, is_last = pp_rank == 0, pp_rank == c.pp - 1
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(c.seed)

    model = make_stage(c, pp_rank, mesh["tp"], mesh["dp"], device)
    stage = PipelineStage(model, pp_rank, c.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(
        stage, n_microbatches=c.microbatches,
        loss_fn=lambda out, tgt: F.cross_entropy(out.float().flatten(0, 1), tgt.flatten(0, 1)),
    )

    train_ds = PackedCode(os.path.join(c.data_dir, "train.npy"), c.seq_len)
    val_ds = PackedCode(os.path.join(c.data_dir, "val.npy"), c.seq_len)
    train_sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=c.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=c.batch_per_replica, sampler=train_sampler,
                              num_workers=6, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=c.batch_per_replica, sampler=val_sampler,
                            num_workers=2, pin_memory=True, drop_last=True)

    optim = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay)
    total = c.epochs * len(train_loader)

    def lr_at(step):
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        t = (step - c.warmup_steps) / max(1, total - c.warmup_steps)
        return (c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * t))) / c.lr

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_at)
    app = AppState(model, optim, sched)
    if os.path.exists(os.path.join(c.ckpt_dir, "last", ".metadata")):
        dcp.load({"app": app}, checkpoint_id=os.path.join(c.ckpt_dir, "last"))
        log.info("resumed at epoch %d", app.epoch)

    def pipeline(x, y, train):
        losses = [] if is_last else None
        run = schedule.step if train else schedule.eval
        tgt = y.to(device, non_blocking=True) if is_last else None
        if is_first:
            run(x.to(device, non_blocking=True), target=tgt, losses=losses)
        else:
            run(target=tgt, losses=losses)
        return torch.stack(losses).mean().detach() if is_last else torch.full((), -1.0, device=device)

    def reduce_for_log(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
        return t.item()

    for epoch in range(app.epoch, c.epochs):
        model.train()
        for i, (x, y) in enumerate(train_loader):
            optim.zero_grad(set_to_none=True)
            loss = pipeline(x, y, train=True)
            optim.step()
            sched.step()
            if i % 50 == 0:
                l = reduce_for_log(loss)
                log.info("epoch %d it %d/%d loss %.4f lr %.3e", epoch, i, len(train_loader), l,
                         sched.get_last_lr()[0])

        model.eval()
        acc = torch.zeros((), device=device)
        with torch.no_grad():
            for x, y in val_loader:
                acc += pipeline(x, y, train=False)
        val = reduce_for_log(acc / len(val_loader))
        log.info("epoch %d val loss %.4f ppl %.2f", epoch, val, math.exp(min(val, 20)))

        app.epoch = epoch + 1
        dcp.save({"app": app}, checkpoint_id=os.path.join(c.ckpt_dir, f"epoch{epoch}"))
        dist.barrier()
        if rank == 0:
            last = os.path.join(c.ckpt_dir, "last")
            if os.path.islink(last):
                os.unlink(last)
            os.symlink(f"epoch{epoch}", last)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
