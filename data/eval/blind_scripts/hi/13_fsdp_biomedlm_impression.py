"""
Findings -> Impression summarization: full fine-tune of BioMedLM (2.7B, GPT-2 architecture)
with PyTorch FSDP (FULL_SHARD, bf16 mixed precision, activation checkpointing).

    torchrun --nnodes=1 --nproc_per_node=8 13_fsdp_biomedlm_impression.py \
        --train data/mimic_sum/train.jsonl --val data/mimic_sum/val.jsonl --out /shared/ckpt/biomedlm_imp
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

PROMPT = "Summarize the chest X-ray findings into an impression.\nFINDINGS: {findings}\nIMPRESSION:"


def tokenize_file(path, tok, max_len):
    examples = []
    with open(path) as f:
        for line in f:
            ex = json.loads(line)
            prompt_ids = tok(PROMPT.format(findings=ex["findings"].strip()))["input_ids"]
            target_ids = tok(" " + ex["impression"].strip())["input_ids"] + [tok.eos_token_id]
            ids = (prompt_ids + target_ids)[:max_len]
            labels = ([-100] * len(prompt_ids) + target_ids)[:max_len]
            examples.append((ids, labels))
    return examples


def load_or_build(path, tok, max_len, cache_dir, rank):
    cache = os.path.join(cache_dir, os.path.basename(path) + f".biomedlm{max_len}.pt")
    # rank 0 tokenizes and writes the cache, the others wait and read it
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(cache_dir, exist_ok=True)
        data = tokenize_file(path, tok, max_len)
        tmp = cache + ".tmp"
        torch.save(data, tmp)
        os.replace(tmp, cache)
    dist.barrier()
    return torch.load(cache)


class SumDataset(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate(batch, pad_id):
    L = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(lab)] = torch.tensor(lab)
        attn[i, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "labels": labels}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stanford-crfm/BioMedLM")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache-dir", default="/shared/cache/tok")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-5)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    train_set = SumDataset(load_or_build(args.train, tok, args.max_len, args.cache_dir, rank))
    val_set = SumDataset(load_or_build(args.val, tok, args.max_len, args.cache_dir, rank))
    coll = functools.partial(collate, pad_id=tok.pad_token_id)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_dl = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, collate_fn=coll,
                          num_workers=2, pin_memory=True)
    val_dl = DataLoader(val_set, batch_size=args.bs, sampler=val_sampler, collate_fn=coll, num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.config.use_cache = False
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap_policy, mixed_precision=bf16,
                 sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.cuda.current_device(),
                 limit_all_gathers=True, use_orig_params=True)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, GPT2Block))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.03 * total), total)

    best_val = math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        sums = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for batch in val_dl:
                batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
                out = model(**batch)
                n_tok = (batch["labels"][:, 1:] != -100).sum()
                sums[0] += out.loss.float() * n_tok
                sums[1] += n_tok
        dist.all_reduce(sums)
        val_loss = (sums[0] / sums[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

        if val_loss < best_val:
            best_val = val_loss
            # every rank takes part in the all-gather; only rank 0 gets the full state on CPU
            save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                cpu_state = model.state_dict()
            if rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save(cpu_state, os.path.join(args.out, "pytorch_model.bin"))
                tok.save_pretrained(args.out)
                with open(os.path.join(args.out, "val.json"), "w") as f:
                    json.dump({"epoch": epoch, "val_loss": val_loss}, f)
                print(f"saved full state dict to {args.out}", flush=True)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
