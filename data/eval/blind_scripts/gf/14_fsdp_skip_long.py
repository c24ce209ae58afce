"""
Chat SFT of Llama-2-13b with FSDP on 8 x A100-40GB.

Memory: FULL_SHARD, bf16 compute, non-reentrant activation checkpointing of every decoder
layer, parameters optionally offloaded to CPU. Batches are dynamically padded; the few very
long conversations in the mix are dropped at run time so the activation peak stays bounded.

    torchrun --nproc_per_node 8 14_fsdp_skip_long.py --data data/chat_sft.jsonl --out ckpt/l2-13b-chat
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    CPUOffload,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

IGNORE = -100


class ChatDataset(Dataset):
    def __init__(self, path, tokenizer, hard_max=4096):
        self.samples = []
        with open(path) as f:
            for line in f:
                conv = json.loads(line)["messages"]
                ids, labels = [tokenizer.bos_token_id], [IGNORE]
                for turn in conv:
                    if turn["role"] == "user":
                        t = tokenizer.encode(f"[INST] {turn['content'].strip()} [/INST]", add_special_tokens=False)
                        ids += t
                        labels += [IGNORE] * len(t)
                    else:
                        t = tokenizer.encode(" " + turn["content"].strip(), add_special_tokens=False)
                        t.append(tokenizer.eos_token_id)
                        ids += t
                        labels += t
                self.samples.append((ids[:hard_max], labels[:hard_max]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def pad_collate(pad_id):
    def fn(batch):
        L = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), IGNORE, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            lab[i, : len(y)] = torch.tensor(y)
            att[i, : len(x)] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": att}
    return fn


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-13b-hf")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/l2-13b-chat")
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--max_tokens_per_batch", type=int, default=8192,
                    help="batches with more (padded) tokens than this are skipped")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup_steps", type=int, default=50)
    ap.add_argument("--offload", action="store_true")
    return ap.parse_args()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(11)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.unk_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        cpu_offload=CPUOffload(offload_params=True) if args.offload else None,
        device_id=device,
        limit_all_gathers=True,
        use_orig_params=True,
    )
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
    )

    ds = ChatDataset(args.data, tok)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=11, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=pad_collate(tok.pad_token_id),
                        num_workers=2, pin_memory=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total_steps = len(loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_steps)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        skipped = 0
        stats = torch.zeros(2, device=device)
        t0 = time.time()
        for batch in loader:
            if batch["input_ids"].numel() > args.max_tokens_per_batch:
                skipped += 1
                continue
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            stats[0] += loss.detach().float()
            stats[1] += 1
            if step % 25 == 0:
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {(stats[0] / stats[1]).item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / 25:.2f}s/step", flush=True)
                stats.zero_()
                t0 = time.time()

        if rank == 0:
            print(f"epoch {epoch} done, skipped {skipped} oversized batches", flush=True)

        save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
            cpu_state = model.state_dict()
        if rank == 0:
            path = os.path.join(args.out, f"epoch{epoch}")
            os.makedirs(path, exist_ok=True)
            torch.save(cpu_state, os.path.join(path, "pytorch_model.bin"))
            tok.save_pretrained(path)
        del cpu_state
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
