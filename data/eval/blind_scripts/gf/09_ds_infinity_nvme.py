"""
ZeRO-Infinity pre-training of a 13B GPT on a single 8-GPU node: parameters and optimizer
state live on the local NVMe array, activations are checkpointed.

    deepspeed --num_gpus 8 09_ds_infinity_nvme.py --init_weights /shared/gpt13b/consolidated_fp32.pt \
        --data /shared/corpus/tokens_uint16.bin --save_dir /shared/ckpt/gpt13b
"""
import argparse
import math
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, n_layer, n_head, seq_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.training else blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class TokenFile(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        x = torch.from_numpy(self.data[s : s + self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--init_weights", default=None)
    p.add_argument("--save_dir", default="/shared/ckpt/gpt13b")
    p.add_argument("--nvme_path", default="/local_nvme/zero_swap")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=1)
    p.add_argument("--global_bs", type=int, default=256)
    p.add_argument("--lr", type=float, default=1.2e-4)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--save_every", type=int, default=500)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def make_config(args, world):
    assert args.global_bs % (args.micro_bs * world) == 0, "global batch must divide micro_bs * world"
    gas = args.global_bs // (args.micro_bs * world)
    aio = {"block_size": 1048576, "queue_depth": 16, "thread_count": 1, "single_submit": False, "overlap_events": True}
    return {
        "train_batch_size": args.global_bs,
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.steps, "warmup_num_steps": 500, "warmup_min_ratio": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True,
                              "buffer_count": 6, "buffer_size": 2e8},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True,
                                  "buffer_count": 4},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "aio": aio,
        "steps_per_print": 50,
    }


def load_consolidated(model, path, rank):
    """Copy a full fp32 state dict (only read on rank 0) into partitioned ZeRO-3 params."""
    state = torch.load(path, map_location="cpu", mmap=True) if rank == 0 else None
    for name, param in model.named_parameters():
        # every rank must enter the gather; only rank 0 writes, then the shards are re-partitioned
        with deepspeed.zero.GatheredParameters(param, modifier_rank=0):
            if rank == 0:
                param.data.copy_(state[name].to(param.dtype))
    del state
    dist.barrier()


def main():
    args = parse_args()
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    cfg = make_config(args, world)

    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme", pin_memory=True):
        model = GPT(vocab=50304, d=5120, n_layer=40, n_head=40, seq_len=args.seq_len)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if rank == 0:
        print(f"model has {n_params / 1e9:.2f}B parameters", flush=True)

    if args.init_weights:
        load_consolidated(model, args.init_weights, rank)

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=cfg)

    ds = TokenFile(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=2, pin_memory=True,
                        drop_last=True)

    _, client = engine.load_checkpoint(args.save_dir) if os.path.isdir(args.save_dir) else (None, None)
    epoch = client.get("epoch", 0) if client else 0

    gas = engine.gradient_accumulation_steps()
    t0 = time.time()
    last_step = engine.global_steps
    while engine.global_steps < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if engine.global_steps == last_step:
                continue  # still accumulating
            gstep = last_step = engine.global_steps
            if gstep % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    el = time.time() - t0
                    print(f"step {gstep} loss {l.item():.4f} ({el / 10:.1f}s/step, gas={gas})", flush=True)
                    t0 = time.time()
            if gstep % args.save_every == 0:
                # collective: every rank writes its own ZeRO partitions into the shared folder
                engine.save_checkpoint(args.save_dir, tag=f"global_step{gstep}", client_state={"epoch": epoch})
            if gstep >= args.steps:
                break
        epoch += 1

    engine.save_checkpoint(args.save_dir, tag="final", client_state={"epoch": epoch})
    # gathers the 16-bit weights onto rank 0 and writes one pytorch_model.bin; called on all ranks
    engine.save_16bit_model(os.path.join(args.save_dir, "hf16"), "pytorch_model.bin")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
