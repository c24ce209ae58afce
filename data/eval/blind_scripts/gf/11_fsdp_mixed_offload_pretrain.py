"""
From-scratch pre-training of a 3B Llama-architecture model with FSDP.

Two workstation GPUs (2 x RTX 4090, 24GB each) cannot hold 3B params + grads + Adam state,
so parameters/grads are offloaded to host RAM (CPUOffload) and every decoder layer is
activation-checkpointed. Config is a small YAML file.

    torchrun --standalone --nproc_per_node=2 11_fsdp_mixed_offload_pretrain.py configs/llama3b.yaml
"""
import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


@dataclass
class TrainConfig:
    data_path: str = "data/fineweb_edu_10B.u16"
    out_dir: str = "runs/llama3b"
    hidden_size: int = 3200
    intermediate_size: int = 8640
    num_layers: int = 26
    num_heads: int = 32
    vocab_size: int = 32000
    seq_len: int = 2048
    micro_batch: int = 2
    grad_accum: int = 32
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 2000
    max_steps: int = 50000
    weight_decay: float = 0.1
    log_interval: int = 10
    ckpt_interval: int = 1000
    num_workers: int = 4
    extra: dict = field(default_factory=dict)


def load_cfg(path):
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    known = {k: v for k, v in raw.items() if k in TrainConfig.__dataclass_fields__}
    return TrainConfig(**known)


class U16Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.arr = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.arr) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        i = idx * self.seq_len
        seq = torch.from_numpy(self.arr[i : i + self.seq_len + 1].astype(np.int64))
        return {"input_ids": seq[:-1], "labels": seq[1:]}


def cosine(step, cfg):
    if step < cfg.warmup:
        return cfg.lr * step / cfg.warmup
    p = min(1.0, (step - cfg.warmup) / (cfg.max_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * p))


def shift_free_loss(model, batch):
    # labels are already shifted by the dataset, so compute CE directly on logits
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())


def main():
    cfg = load_cfg(sys.argv[1]) if len(sys.argv) > 1 else TrainConfig()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)

    mcfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        max_position_embeddings=cfg.seq_len, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(mcfg)
    if rank == 0:
        print(f"params: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B", flush=True)

    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        cpu_offload=CPUOffload(offload_params=True),
        device_id=local_rank,
        sync_module_states=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay, fused=False)

    dataset = U16Tokens(cfg.data_path, cfg.seq_len)
    loader = DataLoader(dataset, batch_size=cfg.micro_batch, shuffle=True, num_workers=cfg.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    step = 0
    ckpt_root = os.path.join(cfg.out_dir, "dcp")
    latest = os.path.join(ckpt_root, "latest.txt")
    if os.path.exists(latest):
        with open(latest) as f:
            tag = f.read().strip()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=os.path.join(ckpt_root, tag))
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optim"]))
        step = int(tag.split("_")[-1])
        if rank == 0:
            print(f"resumed from {tag}", flush=True)

    data_iter = iter(loader)
    model.train()
    t0 = time.time()
    while step < cfg.max_steps:
        lr = cosine(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        running = torch.zeros(1, device=device)
        for micro in range(cfg.grad_accum):
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(loader)
                batch = next(data_iter)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if micro < cfg.grad_accum - 1:
                with model.no_sync():
                    loss = shift_free_loss(model, batch) / cfg.grad_accum
                    loss.backward()
            else:
                loss = shift_free_loss(model, batch) / cfg.grad_accum
                loss.backward()
            running += loss.detach()
        grad_norm = model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if step % cfg.log_interval == 0:
            dist.all_reduce(running, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = (time.time() - t0) / cfg.log_interval
                toks = cfg.micro_batch * cfg.grad_accum * cfg.seq_len * world / dt
                print(f"step {step:6d} | loss {running.item():.4f} | lr {lr:.2e} | gnorm {grad_norm:.2f} "
                      f"| {toks / 1e3:.1f}k tok/s", flush=True)
            t0 = time.time()

        if step % cfg.ckpt_interval == 0:
            tag = f"step_{step}"
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True)):
                state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
                dcp.save(state, checkpoint_id=os.path.join(ckpt_root, tag))
            if rank == 0:
                with open(latest, "w") as f:
                    f.write(tag)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
