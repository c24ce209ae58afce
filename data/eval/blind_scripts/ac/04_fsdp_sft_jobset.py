"""Supervised fine-tuning of a 7B decoder with FSDP (FULL_SHARD, bf16).

Kubernetes JobSet, 2 replicated jobs x 1 pod, 8 x H100 per pod. The JobSet
headless service gives the first pod a stable name; each pod runs

    torchrun --nnodes=2 --nproc_per_node=8 \
        --node_rank=${JOB_COMPLETION_INDEX} \
        --rdzv_backend=static --master_addr=sft-trainer-0-0.sft \
        --master_port=29400 sft_fsdp.py --config /etc/sft/config.yaml

Data and checkpoints live on the shared Filestore mount /shared.
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE_INDEX = -100


class SFTDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as fh:
            self.rows = [json.loads(l) for l in fh]
        self.tok = tok
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = self.tok(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = self.tok(row["response"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = ([self.tok.bos_token_id] + prompt + answer)[: self.max_len]
        labels = ([IGNORE_INDEX] * (len(prompt) + 1) + answer)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    n = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = x
        labels[i, : len(y)] = y
        mask[i, : len(x)] = 1
    return ids, labels, mask


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for ids, labels, mask in loader:
        ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        ntok = (labels[:, 1:] != IGNORE_INDEX).sum()
        acc[0] += out.loss.float() * ntok
        acc[1] += ntok
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def save_full(model, tok, out_dir, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        model.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
        tok.save_pretrained(out_dir)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(cfg["model"])
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    train_ds = SFTDataset(cfg["train_file"], tok, cfg["max_len"])
    val_ds = SFTDataset(cfg["val_file"], tok, cfg["max_len"])
    coll = functools.partial(collate, pad_id=tok.pad_token_id)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg["micro_batch"], sampler=train_sampler,
                          collate_fn=coll, num_workers=4, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg["micro_batch"], sampler=val_sampler,
                        collate_fn=coll, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(cfg["model"], torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        limit_all_gathers=True,
        use_orig_params=True,
    )

    accum = cfg["global_batch"] // (cfg["micro_batch"] * world)
    steps_per_epoch = len(train_dl) // accum
    total = steps_per_epoch * cfg["epochs"]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, betas=(0.9, 0.95))
    sched = get_linear_schedule_with_warmup(opt, int(0.03 * total), total)
    if rank == 0:
        print(f"world={world} accum={accum} steps/epoch={steps_per_epoch} total={total}", flush=True)

    step = 0
    best = math.inf
    for epoch in range(cfg["epochs"]):
        model.train()
        t0 = time.time()
        for i, (ids, labels, mask) in enumerate(train_dl):
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
            sync = (i + 1) % accum == 0
            ctx = model.no_sync() if not sync else contextlib_null()
            with ctx:
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / accum
                loss.backward()
            if not sync:
                continue
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach() * accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.2f}s/it",
                          flush=True)

        val_loss = evaluate(model, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val_loss {val_loss:.4f}", flush=True)
        if val_loss < best:
            best = val_loss
            save_full(model, tok, os.path.join(cfg["output_dir"], "best"), rank)

    save_full(model, tok, os.path.join(cfg["output_dir"], "final"), rank)
    dist.destroy_process_group()


def contextlib_null():
    import contextlib
    return contextlib.nullcontext()


if __name__ == "__main__":
    main()
