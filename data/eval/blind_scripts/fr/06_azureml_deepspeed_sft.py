"""Supervised fine-tuning of an internal 1.3B decoder with DeepSpeed ZeRO-2 on Azure ML.

Submitted with `az ml job create -f sft-job.yml`:

    command: >-
      python sft_deepspeed.py --train ${{inputs.sft_data}}/train.jsonl
      --eval ${{inputs.sft_data}}/eval.jsonl --base ${{inputs.base_model}}
      --output ${{outputs.sft_checkpoints}}
    environment: azureml:acpt-pytorch-2.2-cuda12.1@latest
    compute: azureml:nd96asr-v4
    distribution:
      type: pytorch
      process_count_per_instance: 8
    resources:
      instance_count: 2
"""
import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE_INDEX = -100

DS_CONFIG = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 100,
                   "total_num_steps": 3000},
    },
    "steps_per_print": 50,
    "wall_clock_breakdown": False,
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--save-every", type=int, default=500)
    return p.parse_args()


class SFTDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        self.samples = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                prompt_ids = tokenizer(ex["prompt"], add_special_tokens=False)["input_ids"]
                resp_ids = tokenizer(ex["response"], add_special_tokens=False)["input_ids"]
                ids = [tokenizer.bos_token_id] + prompt_ids + resp_ids + [tokenizer.eos_token_id]
                labels = [IGNORE_INDEX] * (1 + len(prompt_ids)) + resp_ids + [tokenizer.eos_token_id]
                self.samples.append((ids[:max_len], labels[:max_len]))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


class PadCollator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        n = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
        attn = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(lab)] = torch.tensor(lab)
            attn[i, :len(ids)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    acc = torch.zeros(2, device=engine.device)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        out = engine(**batch)
        n_tok = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        acc[0] += out.loss.float() * n_tok
        acc[1] += n_tok
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    train_ds = SFTDataset(args.train, tokenizer, args.max_len)
    eval_ds = SFTDataset(args.eval, tokenizer, args.max_len)
    collate = PadCollator(tokenizer.pad_token_id)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=DS_CONFIG)
    micro_bs = engine.train_micro_batch_size_per_gpu()

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1)
    train_dl = DataLoader(train_ds, batch_size=micro_bs, sampler=train_sampler,
                          collate_fn=collate, num_workers=2, pin_memory=True, drop_last=True)
    eval_idx = list(range(rank, len(eval_ds), dist.get_world_size()))
    eval_dl = DataLoader(torch.utils.data.Subset(eval_ds, eval_idx), batch_size=micro_bs,
                         collate_fn=collate, num_workers=2)

    _, client_state = engine.load_checkpoint(args.output)
    start_epoch = client_state["epoch"] if client_state else 0

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()

            if engine.is_gradient_accumulation_boundary():
                step = engine.global_steps
                if step % args.eval_every == 0:
                    eval_loss = evaluate(engine, eval_dl)
                    if rank == 0:
                        print(f"step {step} eval_loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}",
                              flush=True)
                if step % args.save_every == 0:
                    engine.save_checkpoint(args.output, tag=f"step{step}", client_state={"epoch": epoch})

        engine.save_checkpoint(args.output, tag=f"epoch{epoch}", client_state={"epoch": epoch + 1})

    dist.barrier()
    if rank == 0:
        print("training done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
