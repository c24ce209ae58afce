"""Instruction tuning of a 3B chat model with DeepSpeed ZeRO-3 on Vertex AI.

Custom job, 2 x a2-ultragpu-8g. The container entrypoint is

    torchrun --nnodes=${WORLD_SIZE} --node_rank=${RANK} --nproc_per_node=8 \
        --master_addr=${MASTER_ADDR} --master_port=${MASTER_PORT} \
        zero3_sft.py --data /gcs/llm-data/chat-sft/v7 --work /gcs/llm-runs/chat3b-sft-v7

(on Vertex, WORLD_SIZE/RANK are the number and index of the replicas; torchrun
re-exports them per process.) /gcs is the Cloud Storage FUSE mount shared by all VMs.
"""
import argparse
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--base", default="/gcs/llm-models/base-3b")
    ap.add_argument("--micro-bs", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=2048)
    return ap.parse_args()


def ds_config(args, world_size, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": int(0.03 * total_steps)}},
        "steps_per_print": 100,
    }


def tokenize_file(path, tok, max_len):
    out = []
    with open(path) as f:
        for line in f:
            conv = json.loads(line)["messages"]
            ids = tok.apply_chat_template(conv, tokenize=True)[:max_len]
            prompt_len = len(tok.apply_chat_template(conv[:-1], tokenize=True, add_generation_prompt=True))
            labels = [-100] * min(prompt_len, len(ids)) + ids[prompt_len:]
            out.append((ids, labels))
    return out


def load_or_build(split, args, tok, rank):
    cache = os.path.join(args.work, "cache", f"{split}_{args.max_len}.pt")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        data = tokenize_file(os.path.join(args.data, f"{split}.jsonl"), tok, args.max_len)
        torch.save(data, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    return torch.load(cache)


class ListDataset(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_collate(pad_id):
    def collate(batch):
        n = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), n), pad_id)
        lab = torch.full((len(batch), n), -100)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, :len(x)] = torch.tensor(x)
            lab[i, :len(y)] = torch.tensor(y)
            mask[i, :len(x)] = 1
        return {"input_ids": ids, "labels": lab, "attention_mask": mask}
    return collate


@torch.no_grad()
def eval_loss(engine, loader):
    engine.eval()
    tot = torch.zeros(2, device=engine.device)
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**batch).loss
        n = (batch["labels"][:, 1:] != -100).sum()
        tot += torch.stack([loss.float() * n, n.float()])
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1]).item()


@torch.no_grad()
def sample_reply(engine, tok, prompt):
    # every rank has to run generate under ZeRO-3: each forward gathers the shards
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt").to(engine.device)
    out = engine.module.generate(ids, max_new_tokens=64, do_sample=False, synced_gpus=True)
    return tok.decode(out[0, ids.size(1):], skip_special_tokens=True)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.base)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    train_items = load_or_build("train", args, tok, rank)
    eval_items = load_or_build("eval", args, tok, rank)

    train_ds = ListDataset(train_items)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=3)
    collate = make_collate(tok.pad_token_id)
    train_dl = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, collate_fn=collate,
                          num_workers=2, drop_last=True)
    # each ZeRO-3 forward all-gathers parameters, so every rank gets the same number of eval batches
    n_eval = len(eval_items) // (world * args.micro_bs) * (world * args.micro_bs)
    eval_dl = DataLoader(ListDataset(eval_items[:n_eval][rank::world]), batch_size=args.micro_bs,
                         collate_fn=collate, num_workers=1)

    total_steps = args.epochs * len(train_dl) // args.grad_accum
    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args, world, total_steps))

    ckpt_dir = os.path.join(args.work, "ds_ckpt")
    start_epoch = 0
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        _, client = engine.load_checkpoint(ckpt_dir)
        start_epoch = client["next_epoch"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for batch in train_dl:
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()

        loss_val = eval_loss(engine, eval_dl)
        engine.module.config.use_cache = True
        reply = sample_reply(engine, tok, "Summarize the refund policy in two sentences.")
        engine.module.config.use_cache = False
        if rank == 0:
            print(f"epoch {epoch}: eval loss {loss_val:.4f} ppl {math.exp(loss_val):.2f} "
                  f"({time.time() - tic:.0f}s)\nsample: {reply}", flush=True)

        engine.save_checkpoint(ckpt_dir, tag=f"epoch{epoch}", client_state={"next_epoch": epoch + 1})

    # consolidated 16-bit weights for serving; collective, so all ranks call it
    engine.save_16bit_model(os.path.join(args.work, "final"), "pytorch_model.bin")
    if rank == 0:
        engine.module.config.save_pretrained(os.path.join(args.work, "final"))
        tok.save_pretrained(os.path.join(args.work, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
