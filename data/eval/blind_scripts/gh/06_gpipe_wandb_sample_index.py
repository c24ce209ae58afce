"""
Pretraining run: 1B Llama-style model, GPipe pipeline x FSDP2 x TP, document-aware sample index.

Launch on 2 nodes:
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD_NODE:29500 \
        train_gpipe.py --config configs/llama1b_gpipe.yaml
"""
import argparse
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class RunConfig:
    tokens_path: str = "/mnt/shared/pile_dedup/tokens.u16"
    doc_idx_path: str = "/mnt/shared/pile_dedup/doc_offsets.npy"
    run_dir: str = "/mnt/shared/runs/llama1b_gpipe"
    project: str = "llama1b-3d"
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    ffn: int = 5632
    vocab: int = 50432
    seq_len: int = 2048
    pp: int = 2
    tp: int = 2
    batch_per_dp: int = 32
    microbatches: int = 8
    lr: float = 4e-4
    warmup: int = 1500
    max_steps: int = 60_000
    val_every: int = 1000
    val_batches: int = 20
    ckpt_every: int = 2000
    seed: int = 17


class Block(nn.Module):
    def __init__(self, c: RunConfig):
        super().__init__()
        self.hd = c.dim // c.n_heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(c.dim), nn.RMSNorm(c.dim)
        self.wqkv = nn.ModuleDict({k: nn.Linear(c.dim, c.dim, bias=False) for k in ("q", "k", "v")})
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (self.wqkv[n](h).view(B, T, -1, self.hd).transpose(1, 2) for n in ("q", "k", "v"))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class StageLM(nn.Module):
    def __init__(self, c: RunConfig, stage: int):
        super().__init__()
        per = c.n_layers // c.pp
        self.embed = nn.Embedding(c.vocab, c.dim) if stage == 0 else None
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.dim)) if stage == 0 else None
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(stage * per, (stage + 1) * per)})
        self.norm = nn.RMSNorm(c.dim) if stage == c.pp - 1 else None
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False) if stage == c.pp - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x) + self.pos[: x.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


class DocPackedDataset(Dataset):
    """Windows of seq_len+1 tokens starting at document boundaries (order given by a shared index)."""

    def __init__(self, tokens_path, starts, seq_len):
        self.tokens = np.memmap(tokens_path, dtype=np.uint16, mode="r")
        self.starts, self.seq_len = starts, seq_len

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        s = int(self.starts[i])
        w = torch.from_numpy(self.tokens[s: s + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


def build_sample_index(c: RunConfig, out_path):
    offsets = np.load(c.doc_idx_path, mmap_mode="r")
    n_tokens = np.memmap(c.tokens_path, dtype=np.uint16, mode="r").shape[0]
    starts = offsets[offsets < n_tokens - c.seq_len - 1].astype(np.int64)
    rng = np.random.default_rng(c.seed)
    starts = starts[rng.permutation(len(starts))]
    n_val = c.val_batches * c.batch_per_dp * 64
    tmp = out_path + ".tmp.npz"
    np.savez(tmp, train=starts[n_val:], val=starts[:n_val])
    os.replace(tmp, out_path)


class TrainState(Stateful):
    def __init__(self, model, opt, sched):
        self.model, self.opt, self.sched, self.step = model, opt, sched, 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.sched.load_state_dict(sd["sched"])
        self.step = sd["step"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    c = RunConfig()
    cfg_path = ap.parse_args().config
    if cfg_path:
        c = RunConfig(**{**asdict(c), **yaml.safe_load(open(cfg_path))})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (c.pp * c.tp)
    mesh = init_device_mesh("cuda", (c.pp, dp, c.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
    is_first, is_last = pp_rank == 0, pp_rank == c.pp - 1
    # the single process that owns the loss and talks to wandb
    is_logger = is_last and dp_rank == 0 and tp_rank == 0

    index_path = os.path.join(c.run_dir, "sample_index.npz")
    if rank == 0:
        os.makedirs(c.run_dir, exist_ok=True)
        if not os.path.exists(index_path):
            build_sample_index(c, index_path)
    dist.barrier()
    index = np.load(index_path)
    train_ds = DocPackedDataset(c.tokens_path, index["train"], c.seq_len)
    val_ds = DocPackedDataset(c.tokens_path, index["val"], c.seq_len)

    torch.manual_seed(c.seed)
    with torch.device("meta"):
        model = StageLM(c, pp_rank)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    if is_last:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    for blk in model.layers.values():
        parallelize_module(blk, tp_mesh, {
            "wqkv.q": ColwiseParallel(), "wqkv.k": ColwiseParallel(), "wqkv.v": ColwiseParallel(),
            "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name == "pos":
                p.normal_(0.0, 0.01)
            else:
                p.normal_(0.0, 0.02)

    stage = PipelineStage(model, pp_rank, c.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=c.microbatches,
                             loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / c.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / c.max_steps))))
    state = TrainState(model, opt, sched)
    latest = os.path.join(c.run_dir, "ckpt_latest")
    if os.path.exists(os.path.join(latest, ".metadata")):
        dcp.load({"train": state}, checkpoint_id=latest)

    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    loader = DataLoader(train_ds, batch_size=c.batch_per_dp, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=c.batch_per_dp, sampler=val_sampler, drop_last=True)

    if is_logger:
        wandb.init(project=c.project, config=asdict(c), dir=c.run_dir, resume="allow",
                   id=os.environ.get("WANDB_RUN_ID"))

    def pipe(fn, x, y):
        losses = [] if is_last else None
        if is_first:
            fn(x.to(device, non_blocking=True), target=y.to(device) if is_last else None, losses=losses)
        else:
            fn(target=y.to(device) if is_last else None, losses=losses)
        return torch.stack(losses).mean().detach() if is_last else None

    steps_per_epoch = len(loader)
    epoch = state.step // steps_per_epoch
    sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(state.step % steps_per_epoch):
        next(it)
    t_last = time.time()
    while state.step < c.max_steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        loss = pipe(schedule.step, x, y)
        opt.step()
        sched.step()
        state.step += 1

        if is_last and state.step % 10 == 0:
            # all members of a last-stage dp group are last-stage ranks
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
            if is_logger:
                now = time.time()
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0],
                           "tokens_per_s": 10 * c.batch_per_dp * dp * c.seq_len / (now - t_last)},
                          step=state.step)
                t_last = now

        if state.step % c.val_every == 0:
            model.eval()
            tot = torch.zeros((), device=device)
            with torch.no_grad():
                for i, (vx, vy) in enumerate(val_loader):
                    if i == c.val_batches:
                        break
                    l = pipe(schedule.eval, vx, vy)
                    if is_last:
                        tot += l
            model.train()
            if is_last:
                dist.all_reduce(tot, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
                if is_logger:
                    wandb.log({"val/loss": tot.item() / c.val_batches}, step=state.step)

        if state.step % c.ckpt_every == 0:
            dcp.save({"train": state}, checkpoint_id=os.path.join(c.run_dir, f"ckpt_{state.step}"))
            dist.barrier()
            if rank == 0:
                if os.path.islink(latest):
                    os.remove(latest)
                os.symlink(f"ckpt_{state.step}", latest)
            dist.barrier()

    if is_logger:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
