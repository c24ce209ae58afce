# -*- coding: utf-8 -*-
"""
蛋白质序列 MLM 预训练 (ESM 风格, ~650M), FSDP + bf16.

torchrun --nnodes=4 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d \
    --rdzv-endpoint=$MASTER_ADDR:29500 09_fsdp_protein_mlm.py --cfg configs/esm650m.yaml
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

AA = "ACDEFGHIKLMNPQRSTVWYXBZUO"
PAD, MASK, CLS, EOS = 0, 1, 2, 3
TOK = {a: i + 4 for i, a in enumerate(AA)}
VOCAB = len(TOK) + 4


class Block(nn.Module):
    def __init__(self, d, h, ff):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x, pad_mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


class ProteinLM(nn.Module):
    def __init__(self, d=1280, layers=33, heads=20, max_len=1024):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = nn.Embedding(max_len + 2, d)
        self.blocks = nn.ModuleList([Block(d, heads, 4 * d) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        pad = ids == PAD
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.emb(ids) + self.pos(pos)[None]
        for b in self.blocks:
            x = b(x, pad)
        return self.lm_head(self.ln(x))


class FastaShards(IterableDataset):
    """按 rank 和 worker 切分 shard 文件, 每个 shard 是一行一条序列."""

    def __init__(self, files, rank, world, max_len, seed, epoch=0):
        self.files, self.rank, self.world = files, rank, world
        self.max_len, self.seed, self.epoch = max_len, seed, epoch

    def __iter__(self):
        wi = get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if wi else (0, 1)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.files), generator=g).tolist()
        mine = [self.files[i] for i in order][self.rank::self.world][wid::nw]
        for fn in mine:
            with open(fn) as f:
                for line in f:
                    seq = line.strip()[: self.max_len]
                    if seq:
                        yield torch.tensor([CLS] + [TOK.get(c, TOK["X"]) for c in seq] + [EOS])


def mask_batch(seqs, p=0.15):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), PAD)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    labels = ids.clone()
    special = (ids == PAD) | (ids == CLS) | (ids == EOS)
    m = (torch.rand(ids.shape) < p) & ~special
    labels[~m] = -100
    r = torch.rand(ids.shape)
    ids[m & (r < 0.8)] = MASK
    rnd = m & (r >= 0.8) & (r < 0.9)
    ids[rnd] = torch.randint(4, VOCAB, (int(rnd.sum()),))
    return ids, labels


def save_full(model, path, step, rank):
    # 保存完整权重, 方便下游直接用未包装的模型加载
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save({"model": state, "step": step}, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"[save] step {step} -> {path}", flush=True)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    torch.manual_seed(cfg.get("seed", 0))
    model = ProteinLM(cfg["d_model"], cfg["layers"], cfg["heads"], cfg["max_len"])
    out_dir = cfg["out_dir"]
    full_path = os.path.join(out_dir, "model_full.pt")
    start_step = 0
    if os.path.exists(full_path):
        ck = torch.load(full_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        start_step = ck["step"]
        if rank == 0:
            print(f"从 step {start_step} 继续训练", flush=True)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32),
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98),
                            eps=1e-8, weight_decay=0.01)
    # 注: 优化器状态不保存, 恢复时重新 warmup 一小段
    warm = cfg["warmup"] if start_step == 0 else cfg["rewarm"]

    def lr_lambda(s):
        s_abs = s + start_step
        if s < warm:
            return (s + 1) / warm
        return max(0.1, 1 - s_abs / cfg["max_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    files = sorted(os.path.join(cfg["data_dir"], f) for f in os.listdir(cfg["data_dir"])
                   if f.endswith(".txt"))
    step, epoch = start_step, 0
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    t0 = time.time()
    while step < cfg["max_steps"]:
        ds = FastaShards(files, rank, world, cfg["max_len"], cfg.get("seed", 0), epoch)
        dl = DataLoader(ds, batch_size=cfg["micro_bsz"], collate_fn=mask_batch, num_workers=4)
        n_local = 0
        for ids, labels in dl:
            # shard 长度不一样, 每步先确认所有 rank 都还有数据, 否则 FSDP 的 all-gather 会卡住
            more = torch.ones(1, device=device)
            dist.all_reduce(more, op=dist.ReduceOp.MIN)
            if more.item() == 0:
                break
            ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            logits = model(ids)
            loss = loss_fn(logits.float().view(-1, VOCAB), labels.view(-1))
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            n_local += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} ppl {math.exp(l.item()):.2f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 50:.2f}s/step",
                          flush=True)
                    t0 = time.time()
            if step % cfg["save_every"] == 0:
                save_full(model, full_path, step, rank)
            if step >= cfg["max_steps"]:
                break
        else:
            # 本 rank 的数据先用完: 告诉其他 rank 退出本 epoch
            done = torch.zeros(1, device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        epoch += 1

    save_full(model, full_path, step, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
