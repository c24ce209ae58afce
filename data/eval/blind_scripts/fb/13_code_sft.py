"""Code-completion SFT (fill-in-the-middle + plain completion) with DeepSpeed ZeRO-2.

torchrun --nproc_per_node 8 code_sft.py --ds_config configs/zero2.json --model bigcode/starcoder2-7b \
    --train data/code_sft/train.parquet --valid data/code_sft/valid.parquet --epochs 4
"""
import argparse
import json
import math
import os
import random

import deepspeed
import pandas as pd
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<fim_prefix>", "<fim_middle>", "<fim_suffix>"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds_config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--fim_rate", type=float, default=0.5)
    ap.add_argument("--save_dir", default="ckpt/code-sft")
    ap.add_argument("--seed", type=int, default=3407)
    return ap.parse_args()


class CodeFiles(Dataset):
    def __init__(self, path, tok, seq_len, fim_rate, seed):
        self.df = pd.read_parquet(path, columns=["content"])
        self.tok, self.seq_len, self.fim_rate = tok, seq_len, fim_rate
        self.seed = seed

    def __len__(self):
        return len(self.df)

    def _fim(self, text, rng):
        if len(text) < 16 or rng.random() > self.fim_rate:
            return text
        a, b = sorted(rng.sample(range(len(text)), 2))
        prefix, middle, suffix = text[:a], text[a:b], text[b:]
        return f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{middle}"

    def __getitem__(self, i):
        rng = random.Random(self.seed * 1_000_003 + i)
        text = self._fim(self.df.iloc[i]["content"], rng)
        ids = self.tok(text, truncation=True, max_length=self.seq_len)["input_ids"] + [self.tok.eos_token_id]
        return torch.tensor(ids[: self.seq_len])


def pad(pad_id):
    def f(batch):
        n = max(len(x) for x in batch)
        ids = torch.full((len(batch), n), pad_id)
        labels = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = x
            labels[i, : len(x)] = x
            mask[i, : len(x)] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return f


@torch.no_grad()
def valid_loss(engine, loader):
    engine.eval()
    s = torch.zeros(2, device=engine.device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        s += torch.stack([loss.double() * n, n.double()])
    dist.all_reduce(s)
    engine.train()
    return (s[0] / s[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    with open(args.ds_config) as f:
        ds_config = json.load(f)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    train_ds = CodeFiles(args.train, tok, args.seq_len, args.fim_rate, args.seed)
    valid_ds = CodeFiles(args.valid, tok, args.seq_len, 0.0, args.seed)

    mbs = ds_config["train_micro_batch_size_per_gpu"]
    gas = ds_config.get("gradient_accumulation_steps", 1)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=mbs, sampler=train_sampler, collate_fn=pad(tok.pad_token_id),
                          num_workers=8, pin_memory=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, batch_size=mbs, collate_fn=pad(tok.pad_token_id),
                          sampler=DistributedSampler(valid_ds, num_replicas=world, rank=rank, shuffle=False))

    ds_config["scheduler"] = {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": math.ceil(len(train_dl) / gas) * args.epochs,
                   "warmup_num_steps": 200, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1},
    }

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    history = []
    for epoch in range(args.epochs):
        engine.train()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary() and engine.global_steps % 25 == 0 and rank == 0:
                print(f"epoch {epoch} it {i}/{len(train_dl)} step {engine.global_steps} "
                      f"loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}", flush=True)

        vl = valid_loss(engine, valid_dl)
        history.append({"epoch": epoch, "valid_loss": vl, "step": engine.global_steps})
        if rank == 0:
            print(f"== epoch {epoch} valid loss {vl:.4f} ppl {math.exp(vl):.3f}", flush=True)
        engine.save_checkpoint(args.save_dir, tag=f"epoch{epoch}", client_state={"history": history})

    engine.save_16bit_model(os.path.join(args.save_dir, "hf"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.save_dir, "hf"))
        engine.module.config.save_pretrained(os.path.join(args.save_dir, "hf"))
        with open(os.path.join(args.save_dir, "history.json"), "w") as f:
            json.dump(history, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
