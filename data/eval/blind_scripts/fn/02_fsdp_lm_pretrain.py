"""Decoder-only LM pre-training with FSDP.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD_NODE:29500 02_fsdp_lm_pretrain.py experiment=gpt_350m
"""
import functools
import logging
import math
import os
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("div", lambda a, b: a // b, replace=True)


class TokenBlockDataset(Dataset):
    """Fixed-length blocks over a memory-mapped uint16 token file."""

    def __init__(self, path, block_size):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block_size = block_size
        self.n_blocks = (len(self.data) - 1) // block_size

    def __len__(self):
        return self.n_blocks

    def __getitem__(self, idx):
        start = idx * self.block_size
        chunk = torch.from_numpy(self.data[start:start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def tokenize_corpus(text_dir, out_path, tokenizer):
    ids = []
    for f in sorted(Path(text_dir).glob("*.txt")):
        ids.extend(tokenizer.encode(f.read_text()))
        ids.append(tokenizer.eos_token_id)
    arr = np.array(ids, dtype=np.uint16)
    tmp = out_path + ".tmp"
    arr.tofile(tmp)
    os.replace(tmp, out_path)


def build_token_file(cfg, rank):
    out_path = to_absolute_path(cfg.data.token_file)
    if rank == 0 and not os.path.exists(out_path):
        tokenizer = instantiate(cfg.tokenizer)
        log.info("tokenizing %s -> %s", cfg.data.text_dir, out_path)
        tokenize_corpus(to_absolute_path(cfg.data.text_dir), out_path, tokenizer)
    dist.barrier()
    return out_path


def lr_at(step, cfg):
    if step < cfg.sched.warmup_steps:
        return cfg.optim.lr * (step + 1) / cfg.sched.warmup_steps
    t = (step - cfg.sched.warmup_steps) / max(1, cfg.sched.max_steps - cfg.sched.warmup_steps)
    return cfg.sched.min_lr + 0.5 * (cfg.optim.lr - cfg.sched.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def save_full_checkpoint(model, optimizer, step, path, rank):
    save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
        model_state = model.state_dict()
        optim_state = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        tmp = path + ".tmp"
        torch.save({"model": model_state, "optim": optim_state, "step": step}, tmp)
        os.replace(tmp, path)
        log.info("saved %s", path)
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, device, max_batches):
    model.eval()
    total = torch.zeros(2, device=device)
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum")
        total[0] += loss
        total[1] += y.numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


@hydra.main(version_base="1.3", config_path="conf", config_name="pretrain")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    # run dir must be on the shared filesystem for multi-node jobs
    run_dir = Path(to_absolute_path(cfg.paths.ckpt_root)) / HydraConfig.get().job.override_dirname
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml")
    dist.barrier()

    token_file = build_token_file(cfg, rank)
    train_ds = TokenBlockDataset(token_file, cfg.model.block_size)
    val_ds = TokenBlockDataset(to_absolute_path(cfg.data.val_token_file), cfg.model.block_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.data.micro_batch, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=cfg.data.micro_batch, sampler=val_sampler,
                            num_workers=2, pin_memory=True)

    model = instantiate(cfg.model.net)
    ckpt_path = run_dir / "latest.pt"
    start_step, optim_state = 0, None
    if ckpt_path.exists():
        # full (unsharded) state dict, so it loads with any world size
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optim_state = ckpt["optim"]
        start_step = ckpt["step"]
        del ckpt

    block_cls = hydra.utils.get_class(cfg.model.block_class)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        mixed_precision=mp,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        use_orig_params=True,
    )
    optimizer = instantiate(cfg.optim, params=model.parameters())
    if optim_state is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            flat = FSDP.optim_state_dict_to_load(model, optimizer, optim_state)
        optimizer.load_state_dict(flat)
        del optim_state
        log.info("rank %d resumed at step %d", rank, start_step)

    accum = cfg.train.grad_accum
    step = start_step
    epoch = step * accum // max(1, len(train_loader))
    model.train()
    while step < cfg.sched.max_steps:
        train_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / accum
            loss.backward()
            if (i + 1) % accum != 0:
                continue
            model.clip_grad_norm_(cfg.train.clip)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, cfg)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.train.log_every == 0:
                l = loss.detach() * accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    log.info("step %d loss %.4f lr %.2e", step, l.item(), lr_at(step, cfg))
            if step % cfg.train.eval_every == 0:
                val_loss = evaluate(model, val_loader, device, cfg.train.eval_batches)
                if rank == 0:
                    log.info("step %d val_loss %.4f ppl %.2f", step, val_loss, math.exp(val_loss))
            if step % cfg.train.save_every == 0:
                save_full_checkpoint(model, optimizer, step, str(ckpt_path), rank)
            if step >= cfg.sched.max_steps:
                break
        epoch += 1

    save_full_checkpoint(model, optimizer, step, str(ckpt_path), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
